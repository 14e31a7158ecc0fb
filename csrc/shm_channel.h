// The two ends of a shared-memory channel: the receiver creates the segment, the sender
// attaches to it and removes its name, so nothing remains in /dev/shm once both mapped it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "peer.h"
#include "ring.h"
#include "segment.h"

namespace dpp {

class CudaSendPath;
class CudaReceivePath;

// What the receiver learns before it allocates memory for a message.
struct MessageMeta {
  int32_t kind = 0;
  int32_t chunk = 0;
  int32_t microbatch = 0;
  int32_t dtype = 0;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  bool on_cuda = false;
};

struct ChannelSettings {
  int self_rank = 0;
  int peer_rank = 0;
  double timeout_s = 60.0;  // bound of every wait except the receiver's idle wait
  double spin_us = 200;     // a wait polls this long before it sleeps on the futex
};

class ShmReceiver {
 public:
  ShmReceiver(const std::string& name, uint32_t slot_count, uint64_t slot_bytes,
              const ChannelSettings& settings);
  ~ShmReceiver();
  ShmReceiver(const ShmReceiver&) = delete;
  ShmReceiver& operator=(const ShmReceiver&) = delete;

  // Waits for the next message's first fragment. Empty when the sender closed the channel or
  // interrupt() was called. Waits without a deadline while the sender lives.
  std::optional<MessageMeta> next();
  // Copies the current message into host memory and frees its slots; false if interrupted.
  bool read_into(void* destination, uint64_t nbytes);
  // From another thread: makes next()/read_into() return soon and tells the sender to stop.
  void interrupt();
  // Releases the segment (and CUDA resources); call after the reading thread finished.
  void close();

  // Exports a CUDA slot pool (IPC) and registers the ring for staged copies; call before
  // the sender attaches. Throws when built without CUDA.
  void enable_cuda(int device, bool export_pool, uint64_t device_slot_bytes);
  // Queues the current message's copy into device memory on `copy_stream`, calls `queued`
  // (on this thread) once the whole copy is queued, then waits for it and frees the slots;
  // false if interrupted before the copy was queued.
  bool read_into_cuda(void* destination, uint64_t nbytes, uintptr_t copy_stream,
                      const std::function<void()>& queued);

  pid_t sender_pid() const { return sender_.pid(); }
  const std::string& name() const { return segment_.name(); }

  // Building blocks of the copy loops (host here, CUDA in cuda_*.cu).
  const SlotRing& ring() const { return ring_; }
  uint64_t sequence() const { return sequence_; }
  const MessageMeta& current() const { return current_; }
  // Waits (bounded) until slot `sequence` holds the fragment at `offset` of the current
  // message; nullptr if interrupted.
  const SlotDescriptor* fragment(uint64_t sequence, uint64_t offset);
  void release(uint64_t sequence) const { ring_.publish(sequence, false); }
  void finish_message(uint64_t next_sequence);

 private:
  bool wait_attached();
  WaitContext context(bool bounded, const char* what) const;

  SharedSegment segment_;
  SlotRing ring_;
  ChannelSettings settings_;
  PeerProcess sender_;
  std::atomic<bool> stop_{false};
  uint64_t sequence_ = 0;
  MessageMeta current_;
  bool in_message_ = false;
  std::unique_ptr<CudaReceivePath> cuda_;
};

class ShmSender {
 public:
  ShmSender(const std::string& name, const ChannelSettings& settings);
  ~ShmSender();
  ShmSender(const ShmSender&) = delete;
  ShmSender& operator=(const ShmSender&) = delete;

  // Copies a host buffer into the ring; blocks only while the ring is full.
  void send(const MessageMeta& meta, const void* source);
  // Tells the receiver no more messages come (unless it stopped already); releases all.
  void close();

  // Sets up the GPU paths: "ipc" (receiver's pool, device to device), "staged" (through
  // the registered ring) or "auto" (ipc where the pool can be opened). Returns the choice.
  std::string enable_cuda(int device, const std::string& path);
  // Copies a device buffer; `producer_stream` is the stream that wrote it.
  void send_cuda(const MessageMeta& meta, const void* source, uintptr_t producer_stream,
                 uintptr_t copy_stream);

  pid_t receiver_pid() const { return receiver_.pid(); }

  // Building blocks of the copy loops.
  const SlotRing& ring() const { return ring_; }
  uint64_t sequence() const { return sequence_; }
  void set_sequence(uint64_t sequence) { sequence_ = sequence; }
  // Waits (bounded) for slot `sequence` to be free and fills its descriptor.
  SlotDescriptor* acquire(uint64_t sequence, const MessageMeta& meta, uint64_t offset,
                          uint64_t bytes, uint32_t flags);
  void publish(uint64_t sequence) const { ring_.publish(sequence, true); }

 private:
  SharedSegment segment_;
  SlotRing ring_;
  ChannelSettings settings_;
  PeerProcess receiver_;
  uint64_t sequence_ = 0;
  bool closed_ = false;
  std::unique_ptr<CudaSendPath> cuda_;
};

}  // namespace dpp
