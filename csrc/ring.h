// The layout of a channel's shared-memory segment and the waits on its slots.
//
// One sender process and one receiver process share a ring of slots. Both walk the
// slots in the same order (message fragments are consecutive), so each side only needs
// its own sequence number; a slot's `state` word says whose turn it is and doubles as
// the futex both sides sleep on.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "peer.h"

namespace dpp {

constexpr uint32_t kRingMagic = 0x44505052;  // "DPPR"
constexpr uint32_t kRingVersion = 1;
constexpr int kMaxDims = 8;
constexpr size_t kHandleBytes = 64;  // cudaIpcMemHandle_t / cudaIpcEventHandle_t

// Slot state bits.
constexpr uint32_t kSlotFull = 1;    // holds a fragment for the receiver
constexpr uint32_t kSlotWaiter = 2;  // someone sleeps on the futex: the flipping side wakes it

// Slot flags.
constexpr uint32_t kFragmentFirst = 1;
constexpr uint32_t kFragmentLast = 2;
constexpr uint32_t kChannelClosed = 4;   // no payload: the sender closed the channel
constexpr uint32_t kPayloadOnDevice = 8;  // payload sits in the receiver's CUDA slot pool
constexpr uint32_t kTensorOnCuda = 16;    // the tensor lives on a GPU at both ends

struct alignas(64) RingHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t slot_count;
  uint32_t receiver_closed;  // the receiver stopped: a sender waiting for room gives up
  uint64_t slot_bytes;
  uint64_t segment_bytes;
  int32_t receiver_pid;
  int32_t sender_pid;  // 0 until the sender attached; futex word for the receiver's wait
  int32_t receiver_rank;
  int32_t sender_rank;
  // CUDA IPC slot pool exported by the receiver (valid when device_slot_bytes > 0).
  uint64_t device_slot_bytes;
  int32_t receiver_device;
  int32_t reserved;
  unsigned char pool_handle[kHandleBytes];
};

struct alignas(64) SlotDescriptor {
  uint32_t state;
  uint32_t flags;
  int32_t kind;
  int32_t chunk;
  int32_t microbatch;
  int32_t dtype;
  int32_t ndim;
  int32_t reserved;
  int64_t shape[kMaxDims];
  uint64_t total_bytes;  // of the whole message
  uint64_t offset;       // of this fragment within the message
  uint64_t bytes;        // of this fragment
  unsigned char event_handle[kHandleBytes];  // IPC event recorded after a device copy
};

using Clock = std::chrono::steady_clock;

// What a blocked wait watches besides the slot: the peer, a deadline, a stop request
// from this process, and the receiver's "closed" flag in the header.
struct WaitContext {
  const PeerProcess* peer = nullptr;
  const std::atomic<bool>* stop = nullptr;
  const uint32_t* receiver_closed = nullptr;
  bool bounded = true;
  Clock::time_point deadline{};
  const char* what = "";
  double timeout_s = 0;
};

enum class WaitResult { kReady, kStopped, kReceiverClosed };

// A view of a mapped segment as a ring; it does not own the memory.
class SlotRing {
 public:
  static size_t segment_bytes(uint32_t slot_count, uint64_t slot_bytes);

  SlotRing() = default;
  // Lays out a fresh (zeroed) segment.
  static SlotRing initialize(void* base, size_t size, uint32_t slot_count, uint64_t slot_bytes);
  // Checks an attached segment's header against its size.
  static SlotRing validate(void* base, size_t size, const std::string& name);

  RingHeader* header() const { return header_; }
  uint32_t slot_count() const { return header_->slot_count; }
  uint64_t slot_bytes() const { return header_->slot_bytes; }
  SlotDescriptor* slot(uint64_t sequence) const { return &slots_[sequence % slot_count()]; }
  unsigned char* slot_data(uint64_t sequence) const {
    return data_ + (sequence % slot_count()) * slot_bytes();
  }
  unsigned char* data() const { return data_; }
  size_t data_bytes() const { return static_cast<size_t>(slot_count()) * slot_bytes(); }

  // Blocks until the slot's FULL bit equals `full`: spins `spin_us`, then sleeps on the futex
  // in ticks, checking the context between ticks. Throws PeerDied / WaitTimeout.
  WaitResult wait(uint64_t sequence, bool full, const WaitContext& context, double spin_us) const;
  // Flips the slot to FULL (`full`) or FREE and wakes a sleeper if one announced itself.
  void publish(uint64_t sequence, bool full) const;
  // Wakes every sleeper (used when stopping), whatever it waits for.
  void wake_all() const;

 private:
  SlotRing(RingHeader* header, SlotDescriptor* slots, unsigned char* data)
      : header_(header), slots_(slots), data_(data) {}

  RingHeader* header_ = nullptr;
  SlotDescriptor* slots_ = nullptr;
  unsigned char* data_ = nullptr;
};

// One pause of a spin loop: lets the sibling hyperthread run and saves power.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Sleeps while *word == expected, for at most `timeout`; returns on a wake-up or timeout.
void futex_wait(const uint32_t* word, uint32_t expected, std::chrono::microseconds timeout);
void futex_wake(const uint32_t* word);

}  // namespace dpp
