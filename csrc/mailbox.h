// The arrived messages of one rank: filled by the native drain threads (and by Python
// backends through the bindings), taken by the schedule. Waiting spins briefly, then sleeps
// on a futex, so a message that lands right after the wait began is seen within
// microseconds and an idle stage burns no core.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace dpp {

// (kind, chunk, microbatch), as the Python MessageKey.
using MailboxKey = std::tuple<int32_t, int32_t, int32_t>;

class Mailbox {
 public:
  explicit Mailbox(double spin_us) : spin_us_(spin_us < 0 ? 0 : spin_us) {}
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // A key that is already here is a protocol error: it is recorded as the failure.
  void put(const MailboxKey& key, at::Tensor tensor);
  // Records the first failure; every later wait or take reports it.
  void fail(const std::string& message);

  std::optional<at::Tensor> take(const MailboxKey& key);
  bool has(const MailboxKey& key) const;
  std::vector<MailboxKey> keys() const;
  size_t size() const;
  std::optional<std::string> error() const;
  uint32_t version() const { return __atomic_load_n(&version_, __ATOMIC_SEQ_CST); }

  // Blocks until the version differs from `seen` or a failure is recorded (true), or
  // `timeout_s` passes (false).
  bool wait(uint32_t seen, double timeout_s) const;

 private:
  void bump();

  mutable std::mutex mutex_;
  std::map<MailboxKey, at::Tensor> messages_;
  std::optional<std::string> error_;
  std::atomic<bool> failed_{false};
  double spin_us_;
  uint32_t version_ = 0;  // futex word: changes on every put and failure
  mutable std::atomic<uint32_t> sleepers_{0};
};

}  // namespace dpp
