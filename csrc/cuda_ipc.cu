// GPU tensors copied device to device through CUDA IPC: the receiver exports a pool of
// device slots (one IPC event per slot); the sender copies peer to peer into the slot on
// its side stream, records the slot's event and publishes the slot in the ring at once.
// The receiver's side stream waits for that event and copies out; the message is announced
// to the schedule as soon as that copy is queued, and the slot is freed when it is done.
#include <algorithm>
#include <array>
#include <optional>
#include <vector>

#include "cuda_internal.h"
#include "cuda_resources.h"

namespace dpp {

namespace {

// Receiver side: the exported pool and its per-slot interprocess events.
class IpcSlotPool {
 public:
  IpcSlotPool(const SlotRing& ring, int device, uint64_t slot_bytes)
      : slot_bytes_(slot_bytes), buffer_(ring.slot_count() * slot_bytes) {
    RingHeader* header = ring.header();
    cudaIpcMemHandle_t memory;
    cuda_check(cudaIpcGetMemHandle(&memory, buffer_.get()), "cudaIpcGetMemHandle");
    std::memcpy(header->pool_handle, &memory, sizeof(memory));
    events_.reserve(ring.slot_count());
    for (uint32_t i = 0; i < ring.slot_count(); ++i) {
      events_.emplace_back(cudaEventDisableTiming | cudaEventInterprocess);
      cudaIpcEventHandle_t event;
      cuda_check(cudaIpcGetEventHandle(&event, events_.back().get()), "cudaIpcGetEventHandle");
      std::memcpy(ring.slot(i)->event_handle, &event, sizeof(event));
    }
    header->receiver_device = device;
    // Written last: a non-zero size tells the sender the handles above are valid.
    __atomic_store_n(&header->device_slot_bytes, slot_bytes, __ATOMIC_RELEASE);
  }

  const unsigned char* slot(uint64_t sequence) const {
    return static_cast<const unsigned char*>(buffer_.get()) +
           (sequence % events_.size()) * slot_bytes_;
  }
  cudaEvent_t event(uint64_t sequence) const { return events_[sequence % events_.size()].get(); }

 private:
  uint64_t slot_bytes_;
  DeviceBuffer buffer_;
  std::vector<CudaEvent> events_;
};

// Sender side: the receiver's pool and events, opened in this process.
class IpcPeerPool {
 public:
  explicit IpcPeerPool(const SlotRing& ring)
      : slot_bytes_(ring.header()->device_slot_bytes), mapping_(ring.header()->pool_handle) {
    events_.reserve(ring.slot_count());
    for (uint32_t i = 0; i < ring.slot_count(); ++i) {
      events_.push_back(CudaEvent::open_ipc(ring.slot(i)->event_handle));
    }
  }
  uint64_t slot_bytes() const { return slot_bytes_; }
  unsigned char* slot(uint64_t sequence) const {
    return static_cast<unsigned char*>(mapping_.get()) + (sequence % events_.size()) * slot_bytes_;
  }
  cudaEvent_t event(uint64_t sequence) const { return events_[sequence % events_.size()].get(); }

 private:
  uint64_t slot_bytes_;
  IpcMemoryMapping mapping_;
  std::vector<CudaEvent> events_;
};

class IpcSendPath final : public CudaSendPath {
 public:
  // Runs with `device` current.
  IpcSendPath(const ShmSender& sender, int device) : device_(device), pool_(sender.ring()) {}

  ~IpcSendPath() override {
    // Copies into the peer's pool must end before the mapping closes (the copy streams
    // are torch's pooled streams, which live as long as the process).
    DeviceGuard guard(device_);
    if (copy_stream_ != nullptr) cudaStreamSynchronize(copy_stream_);
  }

  const char* kind() const override { return "ipc"; }

  void send(ShmSender& sender, const MessageMeta& meta, const void* source,
            uintptr_t producer_stream, uintptr_t copy_stream) override {
    DeviceGuard guard(device_);
    const cudaStream_t copy = as_stream(copy_stream);
    copy_stream_ = copy;
    cuda_check(cudaEventRecord(ready_.get(), as_stream(producer_stream)),
               "cudaEventRecord on the producer stream");
    cuda_check(cudaStreamWaitEvent(copy, ready_.get(), 0), "cudaStreamWaitEvent (copy stream)");
    const auto* in = static_cast<const unsigned char*>(source);
    uint64_t sequence = sender.sequence();
    uint64_t offset = 0;
    do {
      const uint64_t bytes = std::min<uint64_t>(pool_.slot_bytes(), meta.nbytes - offset);
      const uint32_t flags = kPayloadOnDevice | (offset == 0 ? kFragmentFirst : 0u) |
                             (offset + bytes == meta.nbytes ? kFragmentLast : 0u);
      sender.acquire(sequence, meta, offset, bytes, flags);
      cuda_check(cudaMemcpyAsync(pool_.slot(sequence), in + offset, bytes,
                                 cudaMemcpyDeviceToDevice, copy),
                 "cudaMemcpyAsync into the peer's IPC slot");
      cuda_check(cudaEventRecord(pool_.event(sequence), copy), "cudaEventRecord (IPC event)");
      // The event is recorded before the slot turns FULL, so the receiver waits on this copy.
      sender.publish(sequence++);
      offset += bytes;
    } while (offset < meta.nbytes);
    sender.set_sequence(sequence);
  }

 private:
  int device_;
  IpcPeerPool pool_;
  CudaEvent ready_;
  cudaStream_t copy_stream_ = nullptr;  // of the last send
};

// Receiver side of both GPU paths: each fragment comes from the IPC pool or the ring.
class DeviceReceivePath final : public CudaReceivePath {
 public:
  // Runs with `device` current.
  DeviceReceivePath(const ShmReceiver& receiver, int device, bool export_pool,
                    uint64_t device_slot_bytes)
      : device_(device),
        registration_(receiver.ring().data(), receiver.ring().data_bytes()) {
    if (export_pool) pool_.emplace(receiver.ring(), device, device_slot_bytes);
  }

  ~DeviceReceivePath() override {
    DeviceGuard guard(device_);
    cudaEventSynchronize(copied_[0].get());
    cudaEventSynchronize(copied_[1].get());
  }

  bool read_into(ShmReceiver& receiver, void* destination, uint64_t nbytes,
                 uintptr_t copy_stream, const std::function<void()>& queued) override {
    DeviceGuard guard(device_);
    const cudaStream_t copy = as_stream(copy_stream);
    auto* out = static_cast<unsigned char*>(destination);
    uint64_t sequence = receiver.sequence();
    uint64_t offset = 0;
    std::optional<uint64_t> in_flight;  // slot whose copy-out is still running
    int event = 0;
    while (true) {
      const SlotDescriptor* slot = receiver.fragment(sequence, offset);
      if (slot == nullptr) {
        if (in_flight) release(receiver, *in_flight, copied_[1 - event]);
        return false;
      }
      if (slot->flags & kPayloadOnDevice) {
        if (!pool_) throw TransportFailure("IPC fragment arrived, but no slot pool was exported");
        cuda_check(cudaStreamWaitEvent(copy, pool_->event(sequence), 0),
                   "cudaStreamWaitEvent on the sender's IPC event");
        cuda_check(cudaMemcpyAsync(out + offset, pool_->slot(sequence), slot->bytes,
                                   cudaMemcpyDeviceToDevice, copy),
                   "cudaMemcpyAsync out of the IPC slot");
      } else {
        cuda_check(cudaMemcpyAsync(out + offset, receiver.ring().slot_data(sequence),
                                   slot->bytes, cudaMemcpyHostToDevice, copy),
                   "cudaMemcpyAsync shm ring -> device");
      }
      cuda_check(cudaEventRecord(copied_[event].get(), copy), "cudaEventRecord (copy-out)");
      const bool last = slot->flags & kFragmentLast;
      offset += slot->bytes;
      // Overlap: free the previous slot while this one copies.
      if (in_flight) release(receiver, *in_flight, copied_[1 - event]);
      in_flight = sequence++;
      event = 1 - event;
      if (last) break;
    }
    if (offset != nbytes) throw TransportFailure("short GPU message on the shm channel");
    // Announced before the data is there: the consumer's stream waits for the copy on the
    // device, its host does not. The slot is freed once the copy-out is done.
    queued();
    release(receiver, *in_flight, copied_[1 - event]);
    receiver.finish_message(sequence);
    return true;
  }

 private:
  static void release(ShmReceiver& receiver, uint64_t sequence, const CudaEvent& copied) {
    cuda_check(cudaEventSynchronize(copied.get()), "cudaEventSynchronize (copy-out)");
    receiver.release(sequence);
  }

  int device_;
  HostRegistration registration_;
  std::optional<IpcSlotPool> pool_;
  std::array<CudaEvent, 2> copied_;
};

// True when this process's `device` can address `peer_device` (same numbering assumed:
// both ranks see the same CUDA_VISIBLE_DEVICES, as under torchrun).
bool can_reach(int device, int peer_device) {
  if (device == peer_device) return true;
  int possible = 0;
  cuda_check(cudaDeviceCanAccessPeer(&possible, device, peer_device), "cudaDeviceCanAccessPeer");
  return possible != 0;
}

}  // namespace

std::unique_ptr<CudaSendPath> make_cuda_send_path(const ShmSender& sender, int device,
                                                  const std::string& path) {
  if (path != "auto" && path != "ipc" && path != "staged") {
    throw TransportFailure("unknown GPU path '" + path + "' (auto, ipc or staged)");
  }
  if (path != "staged") {
    DeviceGuard guard(device);
    const RingHeader* header = sender.ring().header();
    const bool exported = __atomic_load_n(&header->device_slot_bytes, __ATOMIC_ACQUIRE) > 0;
    const bool reachable = exported && can_reach(device, header->receiver_device);
    if (reachable) {
      try {
        return std::make_unique<IpcSendPath>(sender, device);
      } catch (const TransportFailure&) {
        if (path == "ipc") throw;
        cudaGetLastError();  // auto: fall back to staging
      }
    } else if (path == "ipc") {
      throw TransportFailure(exported ? "GPU path 'ipc': device " + std::to_string(device) +
                                            " cannot access the receiver's device " +
                                            std::to_string(header->receiver_device)
                                      : "GPU path 'ipc': the receiver exported no slot pool");
    }
  }
  return make_staged_send_path(sender, device);
}

std::unique_ptr<CudaReceivePath> make_cuda_receive_path(const ShmReceiver& receiver, int device,
                                                        bool export_pool,
                                                        uint64_t device_slot_bytes) {
  DeviceGuard guard(device);
  return std::make_unique<DeviceReceivePath>(receiver, device, export_pool, device_slot_bytes);
}

}  // namespace dpp
