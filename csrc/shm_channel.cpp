#include "shm_channel.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "cuda_paths.h"
#include "errors.h"

namespace dpp {

namespace {

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(seconds));
}

void check_meta(const MessageMeta& meta) {
  if (meta.shape.size() > static_cast<size_t>(kMaxDims)) {
    throw TransportFailure("tensor of " + std::to_string(meta.shape.size()) +
                           " dimensions: a channel carries at most " + std::to_string(kMaxDims));
  }
}

}  // namespace

// ---------------------------------------------------------------- receiver

ShmReceiver::ShmReceiver(const std::string& name, uint32_t slot_count, uint64_t slot_bytes,
                         const ChannelSettings& settings)
    : segment_(SharedSegment::create(name, SlotRing::segment_bytes(slot_count, slot_bytes))),
      ring_(SlotRing::initialize(segment_.data(), segment_.size(), slot_count, slot_bytes)),
      settings_(settings) {
  RingHeader* header = ring_.header();
  header->receiver_rank = settings.self_rank;
  header->sender_rank = settings.peer_rank;
  __atomic_store_n(&header->receiver_pid, static_cast<int32_t>(::getpid()), __ATOMIC_RELEASE);
}

ShmReceiver::~ShmReceiver() = default;

WaitContext ShmReceiver::context(bool bounded, const char* what) const {
  WaitContext context;
  context.peer = &sender_;
  context.stop = &stop_;
  context.bounded = bounded;
  context.deadline = deadline_after(settings_.timeout_s);
  context.timeout_s = settings_.timeout_s;
  context.what = what;
  return context;
}

bool ShmReceiver::wait_attached() {
  if (sender_.known()) return true;
  const auto* word = reinterpret_cast<const uint32_t*>(&ring_.header()->sender_pid);
  const auto deadline = deadline_after(settings_.timeout_s);
  while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == 0) {
    if (stop_.load(std::memory_order_acquire)) return false;
    if (Clock::now() >= deadline) {
      segment_.unlink();  // the sender never came: leave nothing behind
      throw WaitTimeout("timed out after " + std::to_string(settings_.timeout_s) +
                        " s waiting for pipeline peer rank " +
                        std::to_string(settings_.peer_rank) + " to attach to channel " +
                        segment_.name());
    }
    futex_wait(word, 0, std::chrono::milliseconds(50));
  }
  sender_ = PeerProcess(settings_.peer_rank,
                        static_cast<pid_t>(__atomic_load_n(word, __ATOMIC_ACQUIRE)));
  segment_.unlink();
  return true;
}

std::optional<MessageMeta> ShmReceiver::next() {
  if (in_message_) throw TransportFailure("next() before the previous message was read");
  if (segment_.data() == nullptr) throw TransportFailure("receive channel is closed");
  if (!wait_attached()) return std::nullopt;
  const auto wait_context = context(false, "waiting for the next message");
  if (ring_.wait(sequence_, true, wait_context, settings_.spin_us) != WaitResult::kReady) {
    return std::nullopt;
  }
  const SlotDescriptor* slot = ring_.slot(sequence_);
  if (slot->flags & kChannelClosed) {
    release(sequence_);
    ++sequence_;
    return std::nullopt;
  }
  if (!(slot->flags & kFragmentFirst) || slot->offset != 0 || slot->ndim < 0 ||
      slot->ndim > kMaxDims) {
    throw TransportFailure("channel " + segment_.name() + ": malformed first fragment");
  }
  current_ = MessageMeta{slot->kind, slot->chunk, slot->microbatch, slot->dtype,
                         std::vector<int64_t>(slot->shape, slot->shape + slot->ndim),
                         slot->total_bytes, (slot->flags & kTensorOnCuda) != 0};
  in_message_ = true;
  return current_;
}

const SlotDescriptor* ShmReceiver::fragment(uint64_t sequence, uint64_t offset) {
  if (sequence != sequence_) {
    const auto wait_context = context(true, "waiting for the rest of a message");
    if (ring_.wait(sequence, true, wait_context, settings_.spin_us) != WaitResult::kReady) {
      return nullptr;
    }
  }
  const SlotDescriptor* slot = ring_.slot(sequence);
  if (slot->offset != offset || slot->kind != current_.kind || slot->chunk != current_.chunk ||
      slot->microbatch != current_.microbatch || slot->offset + slot->bytes > current_.nbytes) {
    throw TransportFailure("channel " + segment_.name() + ": fragment out of order");
  }
  return slot;
}

void ShmReceiver::finish_message(uint64_t next_sequence) {
  sequence_ = next_sequence;
  in_message_ = false;
}

bool ShmReceiver::read_into(void* destination, uint64_t nbytes) {
  if (!in_message_) throw TransportFailure("read_into() without a message from next()");
  if (nbytes != current_.nbytes) {
    throw TransportFailure("read_into() of " + std::to_string(nbytes) + " bytes for a message of " +
                           std::to_string(current_.nbytes));
  }
  auto* out = static_cast<unsigned char*>(destination);
  uint64_t sequence = sequence_;
  uint64_t offset = 0;
  while (true) {
    const SlotDescriptor* slot = fragment(sequence, offset);
    if (slot == nullptr) return false;
    if (slot->flags & kPayloadOnDevice) {
      throw TransportFailure("channel " + segment_.name() +
                             ": a device-pool fragment reached the host copy");
    }
    std::memcpy(out + offset, ring_.slot_data(sequence), slot->bytes);
    offset += slot->bytes;
    const bool last = slot->flags & kFragmentLast;
    release(sequence++);
    if (last) break;
  }
  if (offset != nbytes) throw TransportFailure("channel " + segment_.name() + ": short message");
  finish_message(sequence);
  return true;
}

void ShmReceiver::interrupt() {
  stop_.store(true, std::memory_order_release);
  if (segment_.data() == nullptr) return;
  __atomic_store_n(&ring_.header()->receiver_closed, 1u, __ATOMIC_RELEASE);
  ring_.wake_all();
}

void ShmReceiver::close() {
  if (segment_.data() == nullptr) return;
  interrupt();
  cuda_.reset();
  segment_ = SharedSegment();
}

void ShmReceiver::enable_cuda(int device, bool export_pool, uint64_t device_slot_bytes) {
#ifdef DPP_WITH_CUDA
  cuda_ = make_cuda_receive_path(*this, device, export_pool, device_slot_bytes);
#else
  (void)device;
  (void)export_pool;
  (void)device_slot_bytes;
  throw TransportFailure("the native transport was built without CUDA");
#endif
}

bool ShmReceiver::read_into_cuda(void* destination, uint64_t nbytes, uintptr_t copy_stream,
                                 const std::function<void()>& queued) {
  if (!cuda_) throw TransportFailure("receive channel has no CUDA path (enable_cuda not called)");
  if (!in_message_) throw TransportFailure("read_into_cuda() without a message from next()");
  if (nbytes != current_.nbytes) {
    throw TransportFailure("read_into_cuda() of " + std::to_string(nbytes) +
                           " bytes for a message of " + std::to_string(current_.nbytes));
  }
  return cuda_->read_into(*this, destination, nbytes, copy_stream, queued);
}

// ---------------------------------------------------------------- sender

ShmSender::ShmSender(const std::string& name, const ChannelSettings& settings)
    : segment_(SharedSegment::attach(name)),
      ring_(SlotRing::validate(segment_.data(), segment_.size(), name)),
      settings_(settings) {
  RingHeader* header = ring_.header();
  if (header->sender_rank != settings.self_rank || header->receiver_rank != settings.peer_rank) {
    throw TransportFailure("channel " + name + " was created for ranks " +
                           std::to_string(header->sender_rank) + " -> " +
                           std::to_string(header->receiver_rank) + ", not " +
                           std::to_string(settings.self_rank) + " -> " +
                           std::to_string(settings.peer_rank));
  }
  receiver_ = PeerProcess(settings.peer_rank,
                          static_cast<pid_t>(__atomic_load_n(&header->receiver_pid,
                                                             __ATOMIC_ACQUIRE)));
  segment_.unlink();
  auto* word = reinterpret_cast<uint32_t*>(&header->sender_pid);
  __atomic_store_n(word, static_cast<uint32_t>(::getpid()), __ATOMIC_RELEASE);
  futex_wake(word);
}

ShmSender::~ShmSender() = default;

SlotDescriptor* ShmSender::acquire(uint64_t sequence, const MessageMeta& meta, uint64_t offset,
                                   uint64_t bytes, uint32_t flags) {
  WaitContext context;
  context.peer = &receiver_;
  context.receiver_closed = &ring_.header()->receiver_closed;
  context.deadline = deadline_after(settings_.timeout_s);
  context.timeout_s = settings_.timeout_s;
  context.what = "waiting for a free slot (the receiver is not draining)";
  if (ring_.wait(sequence, false, context, settings_.spin_us) != WaitResult::kReady) {
    throw TransportFailure("pipeline peer rank " + std::to_string(settings_.peer_rank) +
                           " closed its receive channel");
  }
  SlotDescriptor* slot = ring_.slot(sequence);
  slot->flags = flags | (meta.on_cuda ? kTensorOnCuda : 0u);
  slot->kind = meta.kind;
  slot->chunk = meta.chunk;
  slot->microbatch = meta.microbatch;
  slot->dtype = meta.dtype;
  slot->ndim = static_cast<int32_t>(meta.shape.size());
  std::copy(meta.shape.begin(), meta.shape.end(), slot->shape);
  slot->total_bytes = meta.nbytes;
  slot->offset = offset;
  slot->bytes = bytes;
  return slot;
}

void ShmSender::send(const MessageMeta& meta, const void* source) {
  if (closed_) throw TransportFailure("send on a closed channel");
  check_meta(meta);
  const auto* in = static_cast<const unsigned char*>(source);
  uint64_t offset = 0;
  do {
    const uint64_t bytes = std::min<uint64_t>(ring_.slot_bytes(), meta.nbytes - offset);
    const uint32_t flags = (offset == 0 ? kFragmentFirst : 0u) |
                           (offset + bytes == meta.nbytes ? kFragmentLast : 0u);
    acquire(sequence_, meta, offset, bytes, flags);
    std::memcpy(ring_.slot_data(sequence_), in + offset, bytes);
    publish(sequence_++);
    offset += bytes;
  } while (offset < meta.nbytes);
}

void ShmSender::close() {
  if (closed_) return;
  closed_ = true;
  try {
    if (__atomic_load_n(&ring_.header()->receiver_closed, __ATOMIC_ACQUIRE) == 0) {
      acquire(sequence_, MessageMeta{}, 0, 0, kChannelClosed);
      publish(sequence_++);
    }
  } catch (const TransportFailure&) {
    // A receiver that stopped first is a normal shutdown order, not a failure.
    if (__atomic_load_n(&ring_.header()->receiver_closed, __ATOMIC_ACQUIRE) == 0) {
      cuda_.reset();
      segment_ = SharedSegment();
      throw;
    }
  }
  cuda_.reset();
  segment_ = SharedSegment();
}

std::string ShmSender::enable_cuda(int device, const std::string& path) {
#ifdef DPP_WITH_CUDA
  cuda_ = make_cuda_send_path(*this, device, path);
  return cuda_->kind();
#else
  (void)device;
  (void)path;
  throw TransportFailure("the native transport was built without CUDA");
#endif
}

void ShmSender::send_cuda(const MessageMeta& meta, const void* source, uintptr_t producer_stream,
                          uintptr_t copy_stream) {
  if (closed_) throw TransportFailure("send on a closed channel");
  if (!cuda_) throw TransportFailure("send channel has no CUDA path (enable_cuda not called)");
  check_meta(meta);
  cuda_->send(*this, meta, source, producer_stream, copy_stream);
}

}  // namespace dpp
