// GPU tensors staged through the shared-memory ring: device -> registered ring slot on the
// sender's side stream, ring slot -> device on the receiver's side stream.
#include <algorithm>
#include <array>
#include <optional>

#include "cuda_internal.h"
#include "cuda_resources.h"

namespace dpp {

namespace {

class StagedSendPath final : public CudaSendPath {
 public:
  // Runs with `device` current (events belong to the device current at creation).
  StagedSendPath(const ShmSender& sender, int device)
      : device_(device), registration_(sender.ring().data(), sender.ring().data_bytes()) {}

  ~StagedSendPath() override {
    DeviceGuard guard(device_);
    cudaEventSynchronize(copied_[0].get());
    cudaEventSynchronize(copied_[1].get());
  }

  const char* kind() const override { return "staged"; }

  void send(ShmSender& sender, const MessageMeta& meta, const void* source,
            uintptr_t producer_stream, uintptr_t copy_stream) override {
    DeviceGuard guard(device_);
    const cudaStream_t copy = as_stream(copy_stream);
    // The side stream waits for the producer's work up to now; the producer never waits.
    cuda_check(cudaEventRecord(ready_.get(), as_stream(producer_stream)),
               "cudaEventRecord on the producer stream");
    cuda_check(cudaStreamWaitEvent(copy, ready_.get(), 0), "cudaStreamWaitEvent (copy stream)");
    const auto* in = static_cast<const unsigned char*>(source);
    const SlotRing& ring = sender.ring();
    uint64_t sequence = sender.sequence();
    uint64_t offset = 0;
    std::optional<uint64_t> in_flight;  // copied slot not yet handed to the receiver
    int event = 0;
    do {
      const uint64_t bytes = std::min<uint64_t>(ring.slot_bytes(), meta.nbytes - offset);
      const uint32_t flags = (offset == 0 ? kFragmentFirst : 0u) |
                             (offset + bytes == meta.nbytes ? kFragmentLast : 0u);
      sender.acquire(sequence, meta, offset, bytes, flags);
      cuda_check(cudaMemcpyAsync(ring.slot_data(sequence), in + offset, bytes,
                                 cudaMemcpyDeviceToHost, copy),
                 "cudaMemcpyAsync device -> shm ring");
      cuda_check(cudaEventRecord(copied_[event].get(), copy), "cudaEventRecord (staged copy)");
      // Overlap: publish the previous fragment while this one copies.
      if (in_flight) publish(sender, *in_flight, copied_[1 - event]);
      in_flight = sequence++;
      event = 1 - event;
      offset += bytes;
    } while (offset < meta.nbytes);
    publish(sender, *in_flight, copied_[1 - event]);
    sender.set_sequence(sequence);
  }

 private:
  static void publish(ShmSender& sender, uint64_t sequence, const CudaEvent& copied) {
    cuda_check(cudaEventSynchronize(copied.get()), "cudaEventSynchronize (staged copy)");
    sender.publish(sequence);
  }

  int device_;
  HostRegistration registration_;
  CudaEvent ready_;
  std::array<CudaEvent, 2> copied_;
};

}  // namespace

std::unique_ptr<CudaSendPath> make_staged_send_path(const ShmSender& sender, int device) {
  DeviceGuard guard(device);
  return std::make_unique<StagedSendPath>(sender, device);
}

}  // namespace dpp
