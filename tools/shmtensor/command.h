// Subcommands of the `shmtensor` program register themselves here, one file each, so the
// program's main() stays thin and each command's logic lives beside its registration.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <vector>

namespace shmtensor::tool {

using CommandAdder = std::function<void(CLI::App& app)>;
// Each command file defines `static const bool registered = register_command(add_x);`.
bool register_command(CommandAdder adder);
std::vector<CommandAdder>& registered_commands();

}  // namespace shmtensor::tool
