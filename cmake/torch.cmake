# The optional libtorch bridge (docs/torch.md): whether to build it, decided once at configure
# time and said in the output either way.
#
# SHMTENSOR_BUILD_TORCH: AUTO (build it when find_package(Torch) succeeds), ON (fail when it
# cannot be built), OFF. Sets SHMTENSOR_WITH_TORCH (ON/OFF) and, when ON,
# SHMTENSOR_TORCH_VERSION, in the caller's scope; the imported target `torch` then exists for
# the top directory and every subdirectory.
#
# find_package(Torch) runs inside a function: TorchConfig and Caffe2Config set many
# variables (CMAKE_MODULE_PATH among them) that must not reach the rest of the build, and
# their targets carry torch's compile flags (-D_GLIBCXX_USE_CXX11_ABI, USE_DISTRIBUTED, ...)
# to their consumers only: shmtensor_torch, the torch tests and shmtensor._torch.

set(SHMTENSOR_BUILD_TORCH AUTO CACHE STRING
    "Build the libtorch bridge (shmtensor::torch, shmtensor._torch): AUTO, ON or OFF")
set_property(CACHE SHMTENSOR_BUILD_TORCH PROPERTY STRINGS AUTO ON OFF)

function(shmtensor_find_torch)
  set(with OFF)
  set(reason "")
  string(TOUPPER "${SHMTENSOR_BUILD_TORCH}" mode)
  if(NOT mode MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "SHMTENSOR_BUILD_TORCH is '${SHMTENSOR_BUILD_TORCH}': use AUTO, ON or OFF")
  endif()
  if(mode STREQUAL "OFF")
    set(reason "SHMTENSOR_BUILD_TORCH=OFF")
  elseif(SHMTENSOR_SANITIZE)
    # libtorch is not instrumented; mixing it into sanitized programs reports its internals.
    set(reason "not in sanitizer builds (SHMTENSOR_SANITIZE=${SHMTENSOR_SANITIZE})")
  else()
    # A pip-installed torch keeps its CMake package inside the Python package: look there
    # first, so that the bridge matches the torch that Python imports.
    set(hints "")
    set(python ${Python_EXECUTABLE})
    if(NOT python)
      set(python /usr/bin/python3)  # python/CMakeLists.txt's default
    endif()
    if(SHMTENSOR_BUILD_PYTHON)
      execute_process(COMMAND ${python} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
                      OUTPUT_VARIABLE hints OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
    # A pip torch's config finds Caffe2's config and torch's libraries with PATHS, which
    # come after the system's: on a machine that also has Debian's libtorch-dev, its headers
    # were the pip torch's and its libraries Debian's. Its own directories go first (here
    # only: this function's scope).
    if(hints AND EXISTS "${hints}/Torch/TorchConfig.cmake")
      cmake_path(GET hints PARENT_PATH torch_share)
      cmake_path(GET torch_share PARENT_PATH torch_root)
      list(PREPEND CMAKE_PREFIX_PATH "${hints}" "${torch_root}")
    endif()
    # Caffe2's config prints STATUS lines even when QUIET.
    set(CMAKE_MESSAGE_LOG_LEVEL WARNING)
    find_package(Torch CONFIG QUIET HINTS ${hints})
    unset(CMAKE_MESSAGE_LOG_LEVEL)
    if(NOT Torch_FOUND)
      set(reason "find_package(Torch) found no usable TorchConfig.cmake (install Debian's "
                 "libtorch-dev, or set Torch_DIR)")
    else()
      # Both sides must use one libstdc++ ABI: std::string and friends cross the bridge.
      get_target_property(torch_options torch INTERFACE_COMPILE_OPTIONS)
      include(CheckCXXSourceCompiles)
      check_cxx_source_compiles("#include <string>
        #if !_GLIBCXX_USE_CXX11_ABI
        #error old ABI
        #endif
        int main() {}" SHMTENSOR_CXX11_ABI)
      set(our_abi 0)
      if(SHMTENSOR_CXX11_ABI)
        set(our_abi 1)
      endif()
      cmake_path(IS_PREFIX TORCH_INSTALL_PREFIX "${TORCH_LIBRARY}" NORMALIZE library_is_its_own)
      if(NOT library_is_its_own)
        set(reason "Torch's config in ${Torch_DIR} found another torch's library "
                   "(${TORCH_LIBRARY}): clear TORCH_LIBRARY and Caffe2_DIR from the cache")
      elseif(torch_options MATCHES "_GLIBCXX_USE_CXX11_ABI=([01])" AND NOT CMAKE_MATCH_1 EQUAL our_abi)
        set(reason "libtorch is built with -D_GLIBCXX_USE_CXX11_ABI=${CMAKE_MATCH_1}, shmtensor "
                   "with ${our_abi}: configure with that flag in CMAKE_CXX_FLAGS, or use a libtorch "
                   "of the other ABI")
      else()
        # Torch 1.13's headers do not compile with every compiler in C++20: clang 14 with
        # libstdc++ 12 stops on std::vector<c10::IValue> of an incomplete type (C++20 made
        # vector's members constexpr). Compile them once here, so that such a compiler builds
        # the rest of shmtensor with the bridge off and says why, rather than failing.
        get_target_property(torch_includes torch INTERFACE_INCLUDE_DIRECTORIES)
        set(CMAKE_REQUIRED_INCLUDES ${torch_includes})
        set(CMAKE_REQUIRED_DEFINITIONS -D_GLIBCXX_USE_CXX11_ABI=${our_abi})
        set(CMAKE_REQUIRED_QUIET ON)
        set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)  # compile only: no link to libtorch
        # The cached result is named after the compiler and torch, so that another of either
        # in the same build directory is probed anew.
        string(MAKE_C_IDENTIFIER
               "SHMTENSOR_TORCH_HEADERS_${CMAKE_CXX_COMPILER_ID}_${CMAKE_CXX_COMPILER_VERSION}_${Torch_VERSION}"
               probe_result)
        check_cxx_source_compiles("#include <ATen/ATen.h>
          int probe() { return sizeof(at::Tensor) > 0 ? 0 : 1; }" ${probe_result})
        if(NOT ${probe_result})
          set(reason "torch's headers (<ATen/ATen.h>) do not compile with ${CMAKE_CXX_COMPILER_ID} "
                     "${CMAKE_CXX_COMPILER_VERSION} in C++${CMAKE_CXX_STANDARD} (clang 14 with "
                     "libstdc++ 12 rejects torch 1.13's headers), build it with GCC")
        else()
          set(with ON)
        endif()
      endif()
      if(with)
        # For shmtensor._torch (python/CMakeLists.txt): TORCH_LIBRARIES does not name it.
        find_library(SHMTENSOR_TORCH_PYTHON_LIBRARY torch_python HINTS "${TORCH_INSTALL_PREFIX}/lib")
      endif()
    endif()
  endif()
  if(with)
    message(STATUS "shmtensor: libtorch bridge ON (Torch ${Torch_VERSION}, ${Torch_DIR}): "
                   "shmtensor::torch, tests labelled torch")
    set(SHMTENSOR_TORCH_VERSION ${Torch_VERSION} PARENT_SCOPE)
  elseif(mode STREQUAL "ON")
    string(JOIN "" reason ${reason})
    message(FATAL_ERROR "SHMTENSOR_BUILD_TORCH=ON but the libtorch bridge cannot be built: ${reason}")
  else()
    string(JOIN "" reason ${reason})
    message(STATUS "shmtensor: libtorch bridge OFF: ${reason}")
  endif()
  set(SHMTENSOR_WITH_TORCH ${with} PARENT_SCOPE)
endfunction()

shmtensor_find_torch()
