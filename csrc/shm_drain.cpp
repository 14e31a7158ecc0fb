#include "shm_drain.h"

#include <memory>
#include <utility>

#include "errors.h"

#ifdef DPP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "cuda_resources.h"
#endif

namespace dpp {

namespace {

void check_size(const MessageMeta& meta) {
  uint64_t expected = at::elementSize(scalar_type_of(meta.dtype));
  for (const int64_t extent : meta.shape) {
    if (extent < 0) throw TransportFailure("message with a negative extent in its shape");
    expected *= static_cast<uint64_t>(extent);
  }
  if (expected != meta.nbytes) {
    throw TransportFailure("message of " + std::to_string(meta.nbytes) +
                           " bytes does not match its shape and dtype");
  }
}

}  // namespace

at::ScalarType scalar_type_of(int32_t code) {
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kHalf;
    case 2: return at::kBFloat16;
    case 3: return at::kDouble;
    case 4: return at::kLong;
    case 5: return at::kInt;
    case 6: return at::kChar;
    case 7: return at::kByte;
    case 8: return at::kBool;
    default: throw TransportFailure("unknown dtype code " + std::to_string(code));
  }
}

ShmDrain::ShmDrain(ShmReceiver& receiver, Mailbox& mailbox, std::string label, int device,
                   uintptr_t copy_stream, uintptr_t consumer_stream)
    : receiver_(receiver),
      mailbox_(mailbox),
      label_(std::move(label)),
      device_(device),
      copy_stream_(copy_stream),
      consumer_stream_(consumer_stream),
      thread_([this] { run(); }) {}

ShmDrain::~ShmDrain() {
  receiver_.interrupt();
  join();
}

void ShmDrain::join() {
  if (thread_.joinable()) thread_.join();
}

void ShmDrain::run() {
  try {
#ifdef DPP_WITH_CUDA
    if (device_ >= 0) {
      // Once for the thread: every arrival is allocated and copied on the copy stream.
      const auto index = static_cast<c10::DeviceIndex>(device_);
      c10::cuda::set_device(index);
      c10::cuda::setCurrentCUDAStream(
          c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(copy_stream_), index));
    }
#endif
    while (true) {
      const std::optional<MessageMeta> meta = receiver_.next();
      if (!meta || !deliver(*meta)) return;
    }
  } catch (const std::exception& error) {
    // Every failure must reach the waiting schedule; the sender learns through the ring.
    mailbox_.fail(label_ + ": " + error.what());
    receiver_.interrupt();
  }
}

at::Tensor ShmDrain::device_tensor(const MessageMeta& meta) const {
#ifdef DPP_WITH_CUDA
  const auto index = static_cast<c10::DeviceIndex>(device_);
  // Allocated on the copy stream (current in this thread); recorded on the consumer's, so
  // the block is not reused for a later arrival while the consumer may still read it.
  at::Tensor tensor = at::empty(
      meta.shape,
      at::TensorOptions().dtype(scalar_type_of(meta.dtype)).device(at::kCUDA, index));
  c10::cuda::CUDACachingAllocator::recordStream(
      tensor.storage().data_ptr(),
      c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(consumer_stream_), index));
  return tensor;
#else
  (void)meta;
  throw TransportFailure("GPU message arrived, but the native transport was built without CUDA");
#endif
}

bool ShmDrain::deliver(const MessageMeta& meta) {
  const MailboxKey key{meta.kind, meta.chunk, meta.microbatch};
  check_size(meta);
  if (!meta.on_cuda) {
    const auto options = at::TensorOptions().dtype(scalar_type_of(meta.dtype));
    at::Tensor tensor = at::empty(meta.shape, options);
    if (!receiver_.read_into(tensor.data_ptr(), meta.nbytes)) return false;
    mailbox_.put(key, std::move(tensor));
    return true;
  }
#ifdef DPP_WITH_CUDA
  if (device_ < 0) throw TransportFailure("GPU message arrived, but this rank has no CUDA path");
  at::Tensor tensor = device_tensor(meta);
  const auto index = static_cast<c10::DeviceIndex>(device_);
  // Put once the copy is queued: the taker's stream waits for `copied` on the device.
  const auto announce = [&] {
    auto copied = std::make_shared<CudaEvent>();
    cuda_check(cudaEventRecord(copied->get(), as_stream(copy_stream_)),
               "cudaEventRecord (message copied)");
    mailbox_.put(
        key, tensor,
        [copied, index] {
          cuda_check(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(index).stream(),
                                         copied->get(), 0),
                     "cudaStreamWaitEvent (message copied)");
        },
        [copied] { return cudaEventQuery(copied->get()) == cudaSuccess; });
  };
  return receiver_.read_into_cuda(tensor.data_ptr(), meta.nbytes, copy_stream_, announce);
#else
  throw TransportFailure("GPU message arrived, but the native transport was built without CUDA");
#endif
}

}  // namespace dpp
