#include "os/code_address.h"

#include <link.h>

#include <cstring>

#include "shmtensor/error.h"

namespace shmtensor::internal {

namespace {

struct FindByAddress {
  std::uintptr_t address;
  bool found = false;
  CodeAddress result;
};

int find_by_address(dl_phdr_info* info, std::size_t, void* data) {
  auto* q = static_cast<FindByAddress*>(data);
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    std::uintptr_t start = info->dlpi_addr + ph.p_vaddr;
    if (q->address >= start && q->address < start + ph.p_memsz) {
      q->found = true;
      q->result.module = info->dlpi_name != nullptr ? info->dlpi_name : "";
      q->result.offset = q->address - info->dlpi_addr;
      return 1;
    }
  }
  return 0;
}

struct FindByName {
  const CodeAddress* where;
  bool module_found = false;
  bool in_code = false;
  std::uintptr_t address = 0;
};

int find_by_name(dl_phdr_info* info, std::size_t, void* data) {
  auto* q = static_cast<FindByName*>(data);
  const char* name = info->dlpi_name != nullptr ? info->dlpi_name : "";
  if (q->where->module != name) return 0;
  q->module_found = true;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD || (ph.p_flags & PF_X) == 0) continue;
    if (q->where->offset >= ph.p_vaddr && q->where->offset < ph.p_vaddr + ph.p_memsz) {
      q->in_code = true;
      q->address = info->dlpi_addr + q->where->offset;
    }
  }
  return 1;  // the first module of that name is the one (the main program comes first)
}

std::string describe(const std::string& module) {
  return module.empty() ? std::string("the main executable") : "'" + module + "'";
}

}  // namespace

CodeAddress code_address_of(std::uintptr_t address) {
  FindByAddress q{address, false, {}};
  dl_iterate_phdr(find_by_address, &q);
  if (!q.found)
    throw Error("the function at address " + std::to_string(address) +
                " is in no loaded module, so a re-executed process cannot find it; the "
                "exec start method needs a function compiled into the program or a library "
                "it links");
  return q.result;
}

std::uintptr_t resolve_code_address(const CodeAddress& where) {
  FindByName q{&where};
  dl_iterate_phdr(find_by_name, &q);
  if (!q.module_found)
    throw Error("the function to run lives in " + describe(where.module) +
                ", which this re-executed process has not loaded: functions for the exec "
                "start method must be in the program or a library it links at start-up, "
                "not in one loaded later with dlopen");
  if (!q.in_code)
    throw Error("offset " + std::to_string(where.offset) + " is not code of " +
                describe(where.module) + ": the re-executed binary differs from the parent's");
  return q.address;
}

}  // namespace shmtensor::internal
