// Watches the process at the other end of a channel, so waits can notice it died.
#pragma once

#include <sys/types.h>

#include <string>

namespace dpp {

class PeerProcess {
 public:
  PeerProcess() = default;
  // `rank` only names the peer in error messages.
  PeerProcess(int rank, pid_t pid);
  PeerProcess(PeerProcess&& other) noexcept;
  PeerProcess& operator=(PeerProcess&& other) noexcept;
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess();

  bool known() const { return pid_ > 0; }
  // False once the process has exited (a zombie counts as exited).
  bool alive() const;
  // Throws PeerDied naming the rank and pid, with `while_doing` as context.
  void check_alive(const std::string& while_doing) const;
  pid_t pid() const { return pid_; }
  int rank() const { return rank_; }

 private:
  int rank_ = -1;
  pid_t pid_ = 0;
  // A pidfd turns readable when the process exits, immune to pid reuse; -1 where the
  // kernel or a seccomp filter refuses pidfd_open, then kill(pid, 0) and /proc decide.
  int pidfd_ = -1;
};

}  // namespace dpp
