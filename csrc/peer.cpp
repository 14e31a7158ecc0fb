#include "peer.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <string>
#include <utility>

#include "errors.h"

namespace dpp {

namespace {

// The state letter of /proc/<pid>/stat: 'Z' (zombie) or 'X' (dead) mean exited.
bool proc_says_exited(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  const char state = line[paren + 2];
  return state == 'Z' || state == 'X';
}

}  // namespace

PeerProcess::PeerProcess(int rank, pid_t pid) : rank_(rank), pid_(pid) {
#ifdef SYS_pidfd_open
  pidfd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd_ < 0 && errno == ESRCH) {
    pidfd_ = -1;
    return;  // already gone: alive() reports it through kill()
  }
#endif
  if (pidfd_ < 0) pidfd_ = -1;
}

PeerProcess::PeerProcess(PeerProcess&& other) noexcept
    : rank_(other.rank_),
      pid_(std::exchange(other.pid_, 0)),
      pidfd_(std::exchange(other.pidfd_, -1)) {}

PeerProcess& PeerProcess::operator=(PeerProcess&& other) noexcept {
  if (this != &other) {
    if (pidfd_ >= 0) ::close(pidfd_);
    rank_ = other.rank_;
    pid_ = std::exchange(other.pid_, 0);
    pidfd_ = std::exchange(other.pidfd_, -1);
  }
  return *this;
}

PeerProcess::~PeerProcess() {
  if (pidfd_ >= 0) ::close(pidfd_);
}

bool PeerProcess::alive() const {
  if (pid_ <= 0) return true;
  if (pidfd_ >= 0) {
    struct pollfd watch {pidfd_, POLLIN, 0};
    const int ready = ::poll(&watch, 1, 0);
    if (ready > 0) return false;
    if (ready == 0) return true;
  }
  if (::kill(pid_, 0) != 0 && errno == ESRCH) return false;
  return !proc_says_exited(pid_);
}

void PeerProcess::check_alive(const std::string& while_doing) const {
  if (!alive()) {
    throw PeerDied("pipeline peer rank " + std::to_string(rank_) + " (pid " +
                   std::to_string(pid_) + ") died while " + while_doing);
  }
}

}  // namespace dpp
