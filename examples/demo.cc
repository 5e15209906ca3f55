// The flagship demo (until the DataLoader exists): a tensor moved into shared memory with
// share_memory_(), then written by a forked child and by its parent, each seeing the
// other's writes in the same bytes. Once for each sharing strategy.
//
// Run it with `make run`, or ./build/examples/demo.
#include <shmtensor/shmtensor.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

namespace st = shmtensor;

namespace {

bool demo(st::SharingStrategy strategy) {
  st::set_sharing_strategy(strategy);
  std::cout << "== sharing strategy: " << st::to_string(strategy) << " ==\n";

  st::Tensor t = st::Tensor::zeros({2, 4});
  st::Tensor row1 = t[1];       // a view, made before sharing
  st::Tensor priv = t.clone();  // a private copy, for contrast
  std::cout << "before share_memory_(): is_shared=" << t.is_shared() << "  data=" << t.raw_data()
            << "\n";
  t.share_memory_();  // in place: every tensor and view on this storage follows
  std::cout << "after  share_memory_(): is_shared=" << t.is_shared() << "  data=" << t.raw_data()
            << "  (the view t[1] follows: " << row1.raw_data() << ", is_shared=" << row1.is_shared()
            << ")\n";

  // Two pipes to take turns: the parent writes first, then the child.
  int to_child[2], to_parent[2];
  if (::pipe(to_child) != 0 || ::pipe(to_parent) != 0) return false;
  std::cout.flush();
  pid_t pid = ::fork();
  if (pid == 0) {
    char c;
    if (::read(to_child[0], &c, 1) != 1) ::_exit(1);
    std::cout << "  child  " << ::getpid() << ": sees row 0 = " << t[0].to_string() << " at "
              << t.raw_data() << ", written by the parent after the fork\n";
    row1.fill_(2.0);
    priv.fill_(2.0);
    std::cout << "  child  " << ::getpid() << ": wrote 2s into row 1 (and into its private copy)\n";
    std::cout.flush();
    // A forked child holds its own reference to every shared storage it inherited; drop them
    // before _exit so that a file_system segment is unlinked when its last holder is done.
    t = row1 = priv = st::Tensor();
    if (::write(to_parent[1], "x", 1) != 1) ::_exit(1);
    ::_exit(0);
  }
  t[0].fill_(1.0);
  std::cout << "  parent " << ::getpid() << ": wrote 1s into row 0\n";
  std::cout.flush();
  char c = 'x';
  bool ok = ::write(to_child[1], &c, 1) == 1 && ::read(to_parent[0], &c, 1) == 1;
  int status = 0;
  ::waitpid(pid, &status, 0);
  for (int fd : {to_child[0], to_child[1], to_parent[0], to_parent[1]}) ::close(fd);
  ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;

  std::cout << "  parent " << ::getpid() << ": sees\n" << t << "\n";
  std::cout << "  its private copy, which the child also wrote, is unchanged here (fork copies "
               "private memory):\n"
            << priv << "\n";
  const bool shared_ok = t.equal(st::Tensor::from_vector<float>({1, 1, 1, 1, 2, 2, 2, 2}, {2, 4}));
  const bool private_ok = priv.equal(st::Tensor::zeros({2, 4}));
  std::cout << (shared_ok && private_ok
                    ? "OK: both processes wrote the same bytes, zero copies\n\n"
                    : "FAILED: the processes did not see each other's writes\n\n");
  return ok && shared_ok && private_ok;
}

}  // namespace

int main() {
  std::cout << std::boolalpha;
  bool ok = true;
  for (st::SharingStrategy s : st::get_all_sharing_strategies()) {
    try {
      ok = demo(s) && ok;
    } catch (const st::Error& e) {
      std::cerr << "error with " << st::to_string(s) << ": " << e.what() << "\n";
      ok = false;
    }
  }
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
