// GPU data paths of the shared-memory channel (defined in cuda_*.cu, built only with CUDA).
// Interfaces here carry no CUDA types, so the host-only code can hold them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "shm_channel.h"

namespace dpp {

class CudaSendPath {
 public:
  virtual ~CudaSendPath() = default;
  virtual const char* kind() const = 0;  // "ipc" or "staged"
  virtual void send(ShmSender& sender, const MessageMeta& meta, const void* source,
                    uintptr_t producer_stream, uintptr_t copy_stream) = 0;
};

class CudaReceivePath {
 public:
  virtual ~CudaReceivePath() = default;
  // Copies the current message into device memory on `copy_stream`, calls `queued` once
  // the last fragment's copy is queued, then synchronizes the copy and frees the slots;
  // false if interrupted before then.
  virtual bool read_into(ShmReceiver& receiver, void* destination, uint64_t nbytes,
                         uintptr_t copy_stream, const std::function<void()>& queued) = 0;
};

std::unique_ptr<CudaSendPath> make_cuda_send_path(const ShmSender& sender, int device,
                                                  const std::string& path);
std::unique_ptr<CudaReceivePath> make_cuda_receive_path(const ShmReceiver& receiver, int device,
                                                        bool export_pool,
                                                        uint64_t device_slot_bytes);

}  // namespace dpp
