#include "mailbox.h"

#include <algorithm>
#include <chrono>

#include "ring.h"

namespace dpp {

namespace {

std::string key_text(const MailboxKey& key) {
  return "(kind " + std::to_string(std::get<0>(key)) + ", chunk " +
         std::to_string(std::get<1>(key)) + ", microbatch " + std::to_string(std::get<2>(key)) +
         ")";
}

constexpr std::chrono::milliseconds kSleepTick{50};

}  // namespace

void Mailbox::put(const MailboxKey& key, at::Tensor tensor, BeforeUse before_use,
                  Landed landed) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto [where, fresh] = messages_.insert_or_assign(
        key, Entry{std::move(tensor), std::move(before_use), std::move(landed)});
    (void)where;
    if (!fresh && !error_) {
      error_ = "duplicate message " + key_text(key);
      failed_.store(true);
    }
  }
  bump();
}

void Mailbox::fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = message;
    failed_.store(true);
  }
  bump();
}

std::optional<at::Tensor> Mailbox::take(const MailboxKey& key) {
  Entry entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = messages_.find(key);
    if (found == messages_.end()) return std::nullopt;
    entry = std::move(found->second);
    messages_.erase(found);
  }
  if (entry.before_use) entry.before_use();
  return std::move(entry.tensor);
}

bool Mailbox::has(const MailboxKey& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return messages_.count(key) != 0;
}

bool Mailbox::landed(const MailboxKey& key) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto found = messages_.find(key);
  if (found == messages_.end()) return false;
  return !found->second.landed || found->second.landed();
}

std::vector<MailboxKey> Mailbox::keys() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<MailboxKey> result;
  result.reserve(messages_.size());
  for (const auto& entry : messages_) result.push_back(entry.first);
  return result;
}

size_t Mailbox::size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return messages_.size();
}

std::optional<std::string> Mailbox::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

void Mailbox::bump() {
  __atomic_add_fetch(&version_, 1u, __ATOMIC_SEQ_CST);
  if (sleepers_.load() != 0) futex_wake(&version_);
}

bool Mailbox::wait(uint32_t seen, double timeout_s) const {
  const auto start = Clock::now();
  const auto changed = [&] { return version() != seen || failed_.load(); };
  // A wait never spins past its own timeout (a zero timeout only checks).
  const auto spin =
      std::chrono::duration<double, std::micro>(std::min(spin_us_, timeout_s * 1e6));
  while (Clock::now() - start < spin) {
    if (changed()) return true;
    for (int i = 0; i < 16; ++i) cpu_relax();
  }
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(timeout_s));
  while (!changed()) {
    const auto left = deadline - Clock::now();
    if (left <= Clock::duration::zero()) return false;
    const auto sleep = std::min<Clock::duration>(left, kSleepTick);
    // Announced before the futex checks the word, so a bump() after the check wakes us.
    sleepers_.fetch_add(1);
    futex_wait(&version_, seen,
               std::chrono::duration_cast<std::chrono::microseconds>(sleep) +
                   std::chrono::microseconds(1));
    sleepers_.fetch_sub(1);
  }
  return true;
}

}  // namespace dpp
