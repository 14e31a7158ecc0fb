// The arrived messages of one rank: filled by the native drain threads (and by Python
// backends through the bindings), taken by the schedule. Waiting spins briefly, then sleeps
// on a futex, so a message that lands right after the wait began is seen within
// microseconds and an idle stage burns no core.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace dpp {

// (kind, chunk, microbatch), as the Python MessageKey.
using MailboxKey = std::tuple<int32_t, int32_t, int32_t>;

// Run by take() on the taking thread before the tensor is handed out: a GPU message is
// announced when its copy is queued, and this makes the taker's current stream wait for
// the copy, so the consumer's kernels queue behind it instead of its host waiting.
using BeforeUse = std::function<void()>;
// Whether an announced GPU message's data has landed (its copy is done).
using Landed = std::function<bool()>;

class Mailbox {
 public:
  explicit Mailbox(double spin_us) : spin_us_(spin_us < 0 ? 0 : spin_us) {}
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // A key that is already here is a protocol error: it is recorded as the failure.
  void put(const MailboxKey& key, at::Tensor tensor, BeforeUse before_use = {},
           Landed landed = {});
  // Records the first failure; every later wait or take reports it.
  void fail(const std::string& message);

  std::optional<at::Tensor> take(const MailboxKey& key);
  bool has(const MailboxKey& key) const;
  // The message is here and its data written (a GPU message's copy has finished).
  bool landed(const MailboxKey& key) const;
  std::vector<MailboxKey> keys() const;
  size_t size() const;
  std::optional<std::string> error() const;
  uint32_t version() const { return __atomic_load_n(&version_, __ATOMIC_SEQ_CST); }
  // Changes the version without a message: wakes a waiter to look again (the schedule's
  // GPU progress, which it decides on as well as on arrivals).
  void notify() { bump(); }

  // Blocks until the version differs from `seen` or a failure is recorded (true), or
  // `timeout_s` passes (false).
  bool wait(uint32_t seen, double timeout_s) const;

 private:
  void bump();

  struct Entry {
    at::Tensor tensor;
    BeforeUse before_use;
    Landed landed;
  };

  mutable std::mutex mutex_;
  std::map<MailboxKey, Entry> messages_;
  std::optional<std::string> error_;
  std::atomic<bool> failed_{false};
  double spin_us_;
  uint32_t version_ = 0;  // futex word: changes on every put and failure
  mutable std::atomic<uint32_t> sleepers_{0};
};

}  // namespace dpp
