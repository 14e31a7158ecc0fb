// RAII owners of CUDA runtime handles, and the status check that names the failing call.
// Included only by the cuda_*.cu files (built with DPP_WITH_CUDA).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "errors.h"
#include "ring.h"

namespace dpp {

static_assert(sizeof(cudaIpcMemHandle_t) == kHandleBytes, "IPC memory handle size");
static_assert(sizeof(cudaIpcEventHandle_t) == kHandleBytes, "IPC event handle size");

inline void cuda_check(cudaError_t status, const std::string& operation) {
  if (status != cudaSuccess) {
    throw TransportFailure(operation + " failed: " + cudaGetErrorName(status) + " (" +
                           cudaGetErrorString(status) + ")");
  }
}

inline cudaStream_t as_stream(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// Makes `device` current for a scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

class CudaEvent {
 public:
  explicit CudaEvent(unsigned flags = cudaEventDisableTiming) {
    cuda_check(cudaEventCreateWithFlags(&event_, flags), "cudaEventCreateWithFlags");
  }
  // Adopts an event opened from another process's handle.
  static CudaEvent open_ipc(const unsigned char* handle_bytes) {
    cudaIpcEventHandle_t handle;
    std::memcpy(&handle, handle_bytes, sizeof(handle));
    cudaEvent_t event = nullptr;
    cuda_check(cudaIpcOpenEventHandle(&event, handle), "cudaIpcOpenEventHandle");
    return CudaEvent(event);
  }
  CudaEvent(CudaEvent&& other) noexcept : event_(std::exchange(other.event_, nullptr)) {}
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  CudaEvent& operator=(CudaEvent&&) = delete;
  ~CudaEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  cudaEvent_t get() const { return event_; }

 private:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  cudaEvent_t event_ = nullptr;
};

// Page-locks a host range (the ring's data area) so copies to and from it are async DMA.
class HostRegistration {
 public:
  HostRegistration(void* data, size_t bytes) : data_(data) {
    cuda_check(cudaHostRegister(data, bytes, cudaHostRegisterPortable),
               "cudaHostRegister of " + std::to_string(bytes) + " bytes of the shm ring");
  }
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  ~HostRegistration() { cudaHostUnregister(data_); }

 private:
  void* data_;
};

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    cuda_check(cudaMalloc(&data_, bytes),
               "cudaMalloc of a " + std::to_string(bytes) + "-byte IPC slot pool");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(data_); }
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

// Another process's device allocation, mapped into this one.
class IpcMemoryMapping {
 public:
  explicit IpcMemoryMapping(const unsigned char* handle_bytes) {
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handle_bytes, sizeof(handle));
    cuda_check(cudaIpcOpenMemHandle(&data_, handle, cudaIpcMemLazyEnablePeerAccess),
               "cudaIpcOpenMemHandle of the receiver's slot pool");
  }
  IpcMemoryMapping(const IpcMemoryMapping&) = delete;
  IpcMemoryMapping& operator=(const IpcMemoryMapping&) = delete;
  ~IpcMemoryMapping() { cudaIpcCloseMemHandle(data_); }
  void* get() const { return data_; }

 private:
  void* data_ = nullptr;
};

}  // namespace dpp
