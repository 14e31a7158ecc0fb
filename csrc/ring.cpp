#include "ring.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <ctime>
#include <string>

#include "errors.h"

namespace dpp {

namespace {

// How long one futex sleep lasts before the peer and the deadline are checked again.
constexpr std::chrono::milliseconds kTick{50};
constexpr size_t kDataAlignment = 4096;

inline uint32_t load(const uint32_t* word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }

size_t data_offset(uint32_t slot_count) {
  const size_t raw = sizeof(RingHeader) + slot_count * sizeof(SlotDescriptor);
  return (raw + kDataAlignment - 1) / kDataAlignment * kDataAlignment;
}

std::string timeout_text(const WaitContext& context) {
  return "timed out after " + std::to_string(context.timeout_s) + " s " + context.what;
}

}  // namespace

void futex_wait(const uint32_t* word, uint32_t expected, std::chrono::microseconds timeout) {
  struct timespec relative {};
  relative.tv_sec = static_cast<time_t>(timeout.count() / 1000000);
  relative.tv_nsec = static_cast<long>(timeout.count() % 1000000) * 1000;
  // Shared (not FUTEX_PRIVATE): the word lives in memory mapped by two processes.
  const long rc = ::syscall(SYS_futex, word, FUTEX_WAIT, expected, &relative, nullptr, 0);
  if (rc != 0 && errno != EAGAIN && errno != ETIMEDOUT && errno != EINTR) {
    throw_errno("futex(FUTEX_WAIT)");
  }
}

void futex_wake(const uint32_t* word) {
  if (::syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0) < 0) {
    throw_errno("futex(FUTEX_WAKE)");
  }
}

size_t SlotRing::segment_bytes(uint32_t slot_count, uint64_t slot_bytes) {
  return data_offset(slot_count) + static_cast<size_t>(slot_count) * slot_bytes;
}

SlotRing SlotRing::initialize(void* base, size_t size, uint32_t slot_count, uint64_t slot_bytes) {
  if (slot_count < 2) throw TransportFailure("a ring needs at least 2 slots, got " +
                                             std::to_string(slot_count));
  if (size < segment_bytes(slot_count, slot_bytes)) {
    throw TransportFailure("segment of " + std::to_string(size) + " bytes is too small for " +
                           std::to_string(slot_count) + " slots of " +
                           std::to_string(slot_bytes) + " bytes");
  }
  auto* bytes = static_cast<unsigned char*>(base);
  auto* header = reinterpret_cast<RingHeader*>(bytes);
  header->magic = kRingMagic;
  header->version = kRingVersion;
  header->slot_count = slot_count;
  header->slot_bytes = slot_bytes;
  header->segment_bytes = size;
  header->receiver_device = -1;
  auto* slots = reinterpret_cast<SlotDescriptor*>(bytes + sizeof(RingHeader));
  return SlotRing(header, slots, bytes + data_offset(slot_count));
}

SlotRing SlotRing::validate(void* base, size_t size, const std::string& name) {
  auto* bytes = static_cast<unsigned char*>(base);
  auto* header = reinterpret_cast<RingHeader*>(bytes);
  if (size < sizeof(RingHeader) || header->magic != kRingMagic ||
      header->version != kRingVersion) {
    throw TransportFailure("shared-memory segment " + name +
                           " is not a DPP channel ring (bad magic or version)");
  }
  if (header->segment_bytes != size || header->slot_count < 2 ||
      segment_bytes(header->slot_count, header->slot_bytes) > size) {
    throw TransportFailure("shared-memory segment " + name + " has an inconsistent header");
  }
  auto* slots = reinterpret_cast<SlotDescriptor*>(bytes + sizeof(RingHeader));
  return SlotRing(header, slots, bytes + data_offset(header->slot_count));
}

WaitResult SlotRing::wait(uint64_t sequence, bool full, const WaitContext& context,
                          double spin_us) const {
  uint32_t* word = &slot(sequence)->state;
  const uint32_t want = full ? kSlotFull : 0;
  const auto spin_end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double, std::micro>(spin_us));
  do {
    for (int i = 0; i < 16; ++i) {
      if ((load(word) & kSlotFull) == want) return WaitResult::kReady;
      cpu_relax();
    }
  } while (Clock::now() < spin_end);
  while (true) {
    uint32_t value = load(word);
    if ((value & kSlotFull) == want) return WaitResult::kReady;
    if (context.stop != nullptr && context.stop->load(std::memory_order_acquire)) {
      return WaitResult::kStopped;
    }
    if (context.receiver_closed != nullptr && load(context.receiver_closed) != 0) {
      return WaitResult::kReceiverClosed;
    }
    if (context.peer != nullptr) context.peer->check_alive(context.what);
    auto sleep = std::chrono::duration_cast<std::chrono::microseconds>(kTick);
    if (context.bounded) {
      const auto left = context.deadline - Clock::now();
      if (left <= Clock::duration::zero()) throw WaitTimeout(timeout_text(context));
      sleep = std::min(sleep, std::chrono::duration_cast<std::chrono::microseconds>(left) +
                                  std::chrono::microseconds(1));
    }
    if ((value & kSlotWaiter) == 0) {
      // Announce the sleeper so the other side's publish() issues a wake-up.
      if (!__atomic_compare_exchange_n(word, &value, value | kSlotWaiter, false,
                                       __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        continue;
      }
      value |= kSlotWaiter;
    }
    futex_wait(word, value, sleep);
  }
}

void SlotRing::publish(uint64_t sequence, bool full) const {
  uint32_t* word = &slot(sequence)->state;
  const uint32_t previous = __atomic_exchange_n(word, full ? kSlotFull : 0u, __ATOMIC_ACQ_REL);
  if (previous & kSlotWaiter) futex_wake(word);
}

void SlotRing::wake_all() const {
  for (uint32_t i = 0; i < slot_count(); ++i) futex_wake(&slots_[i].state);
  futex_wake(reinterpret_cast<const uint32_t*>(&header_->sender_pid));
}

}  // namespace dpp
