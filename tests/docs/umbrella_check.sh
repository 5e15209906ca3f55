#!/usr/bin/env bash
# Every public header (include/shmtensor/*.h; internal/ holds what they need but users do not
# include) is reachable from shmtensor.h, the header the README tells users to include, and
# compiles on its own.
#
# One exception: torch.h (the libtorch bridge, target shmtensor::torch) is NOT reachable from
# shmtensor.h, because it includes libtorch's headers and the library builds and is used
# without libtorch. It must compile on its own too when libtorch's include flags are given
# (TORCH_FLAGS, what CMake passes when the bridge is built); without them it is not compiled.
#
# Usage: umbrella_check.sh SOURCE_DIR CXX [TORCH_FLAGS...]
set -euo pipefail
src=$1
cxx=$2
shift 2
torch_flags=("$@")
inc="$src/include"
optional=(torch.h)  # not included by shmtensor.h: see above
deps=$(echo '#include <shmtensor/shmtensor.h>' | "$cxx" -std=c++20 -I"$inc" -x c++ -M -)
fail=0
count=0
headers=()
for h in "$inc"/shmtensor/*.h; do
  count=$((count + 1))
  name=$(basename "$h")
  if [[ " ${optional[*]} " == *" $name "* ]]; then
    if grep -q "$h" <<<"$deps"; then
      echo "FAIL: $h needs libtorch but shmtensor.h includes it"
      fail=1
    fi
    ((${#torch_flags[@]})) && headers+=("$h")
    continue
  fi
  headers+=("$h")
  [[ $name == shmtensor.h ]] && continue
  if ! grep -q "$h" <<<"$deps"; then
    echo "FAIL: $h is a public header but shmtensor.h does not include it"
    fail=1
  fi
done
# Self-contained: each header compiles as the first and only include.
if ! printf '%s\n' "${headers[@]}" | xargs -P2 -I{} sh -c \
    'h=$1; shift; echo "#include \"$h\"" | "$@" -x c++ -fsyntax-only - || { echo "FAIL: $h does not compile on its own"; exit 1; }' \
    sh {} "$cxx" -std=c++20 -I"$inc" "${torch_flags[@]}"; then
  fail=1
fi
if [[ $fail == 0 ]]; then
  if ((${#torch_flags[@]})); then
    echo "OK: $count public headers, all but torch.h reachable from shmtensor.h, every one self-contained"
  else
    echo "OK: $count public headers, all but torch.h reachable from shmtensor.h and self-contained (torch.h not compiled: no libtorch)"
  fi
fi
exit $fail
