// The `shmtensor` command: doctor, ls, gc, bench. Each subcommand is defined in its own file.
#include <iostream>

#include "command.h"
#include "shmtensor/error.h"

namespace shmtensor::tool {
std::vector<CommandAdder>& registered_commands() {
  static std::vector<CommandAdder> commands;
  return commands;
}
bool register_command(CommandAdder adder) {
  registered_commands().push_back(std::move(adder));
  return true;
}
}  // namespace shmtensor::tool

int main(int argc, char** argv) {
  CLI::App app{"shmtensor: zero-copy tensor sharing between processes — tools"};
  app.require_subcommand(1);
  for (auto& add : shmtensor::tool::registered_commands()) add(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const shmtensor::Error& e) {
    std::cerr << "shmtensor: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
