// A one-way channel between a parent and a forked child, for bytes and lines: how a test
// makes two processes take turns.
#pragma once

#include <errno.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>

namespace shmtensor::testing {

class Pipe {
 public:
  Pipe() { EXPECT_EQ(::pipe2(fds_, O_CLOEXEC), 0) << std::strerror(errno); }
  Pipe(const Pipe&) = delete;
  Pipe& operator=(const Pipe&) = delete;
  ~Pipe() { close_both(); }
  void close_both() {
    for (int& fd : fds_)
      if (fd >= 0) ::close(std::exchange(fd, -1));
  }
  void send(char c = 'x') { ASSERT_EQ(::write(fds_[1], &c, 1), 1) << std::strerror(errno); }
  void send_line(const std::string& s) {
    std::string l = s + "\n";
    ASSERT_EQ(::write(fds_[1], l.data(), l.size()), static_cast<ssize_t>(l.size()));
  }
  // The byte, or 0 at EOF (the other side died).
  char receive() {
    char c = 0;
    ssize_t n;
    do n = ::read(fds_[0], &c, 1);
    while (n == -1 && errno == EINTR);
    return n == 1 ? c : 0;
  }
  std::string receive_line() {
    std::string s;
    for (char c; (c = receive()) != 0 && c != '\n';) s.push_back(c);
    return s;
  }

 private:
  int fds_[2] = {-1, -1};
};

}  // namespace shmtensor::testing
