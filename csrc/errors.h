// Exceptions raised by the native transport; module.cpp maps them to Python classes.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace dpp {

// Any failure of the transport: a system call, a malformed segment, a CUDA or verbs call.
class TransportFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The process on the other end of a channel exited.
class PeerDied : public TransportFailure {
 public:
  using TransportFailure::TransportFailure;
};

// A bounded wait ran out.
class WaitTimeout : public TransportFailure {
 public:
  using TransportFailure::TransportFailure;
};

// `what` failed with the current errno.
[[noreturn]] inline void throw_errno(const std::string& what) {
  const int err = errno;
  throw TransportFailure(what + ": " + std::strerror(err) + " (errno " + std::to_string(err) + ")");
}

}  // namespace dpp
