// Where the time of one small GPU-to-GPU message goes: a two-process ping-pong over CUDA
// IPC with different ways of copying and of telling the receiver that the data is there.
//
//   nvcc -O2 -std=c++17 -o /tmp/ipc_latency profiling/ipc_latency.cu -lcuda
//   /tmp/ipc_latency [round_trips]
//
// Process p runs on device p. Each exports a landing buffer and an interprocess event; the
// peer copies into the landing buffer. The host side of every variant is a word in shared
// memory that the receiver polls, so the figures are the GPU part of a hop plus a few
// hundred nanoseconds. Printed: microseconds one way (half a round trip).
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

void check(CUresult status, const char* what) {
  if (status != CUDA_SUCCESS) {
    const char* name = nullptr;
    cuGetErrorName(status, &name);
    throw std::runtime_error(std::string(what) + ": " + (name ? name : "?"));
  }
}

enum Variant {
  kCurrent,         // sender: P2P copy + IPC event; receiver: wait event, copy out, sync
  kWaitOnly,        // as kCurrent, the receiver waits for the event and syncs, no copy
  kSenderSync,      // sender syncs its copy, then tells; receiver uses the landing buffer
  kSenderSyncCopy,  // as kSenderSync, the receiver copies out and syncs
  kWriteValue,      // sender: copy + cuStreamWriteValue32 to the shared word; no host wait
  kWriteValueCopy,  // as kWriteValue, the receiver copies out and syncs
  kWriteValueAsync, // as kWriteValue, the receiver's copy-out stays ordered on its stream
  kKernel,          // one kernel copies to the peer and writes the shared word
  kVariants
};

const char* kNames[kVariants] = {"current",    "wait-only",    "sender-sync",
                                 "sender-sync+copy", "write-value", "write-value+copy",
                                 "write-value+async-copy", "kernel"};

struct alignas(64) Shared {
  volatile uint32_t arrived[2];  // sequence number of the last message for process p
  volatile uint32_t ready[2];
  cudaIpcMemHandle_t landing[2];
  cudaIpcEventHandle_t filled[2];
};

__global__ void copy_and_signal(const uint4* source, uint4* destination, size_t count,
                                volatile uint32_t* word, uint32_t value) {
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) destination[i] = source[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) *word = value;
}

void spin_until(volatile uint32_t* word, uint32_t value) {
  while (*word < value) {
    __builtin_ia32_pause();
  }
}

struct Process {
  int self = 0;
  int peer = 1;
  Shared* shared = nullptr;
  void* landing = nullptr;       // mine: the peer copies into it
  void* peer_landing = nullptr;  // the peer's, opened
  void* out = nullptr;
  void* source = nullptr;
  cudaEvent_t filled = nullptr;       // mine, exported
  cudaEvent_t peer_filled = nullptr;  // the peer's, opened
  cudaEvent_t ready = nullptr;
  cudaEvent_t done = nullptr;
  cudaStream_t compute = nullptr;
  cudaStream_t copy = nullptr;
  CUdeviceptr peer_word = 0;  // device address of shared->arrived[peer]
  uint32_t generation = 0;  // barriers passed
  uint32_t calls = 0;       // ping_pong calls, for fresh sequence numbers

  void setup() {
    check(cudaSetDevice(self), "cudaSetDevice");
    check(cudaMalloc(&landing, 1 << 20), "cudaMalloc landing");
    check(cudaMalloc(&out, 1 << 20), "cudaMalloc out");
    check(cudaMalloc(&source, 1 << 20), "cudaMalloc source");
    check(cudaMemset(source, self + 1, 1 << 20), "cudaMemset");
    check(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming | cudaEventInterprocess),
          "event filled");
    check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "event ready");
    check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "event done");
    check(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking), "stream");
    check(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking), "stream");
    check(cudaIpcGetMemHandle(&shared->landing[self], landing), "cudaIpcGetMemHandle");
    check(cudaIpcGetEventHandle(&shared->filled[self], filled), "cudaIpcGetEventHandle");
    check(cudaHostRegister(shared, sizeof(Shared), cudaHostRegisterMapped | cudaHostRegisterPortable),
          "cudaHostRegister");
    void* device_shared = nullptr;
    check(cudaHostGetDevicePointer(&device_shared, shared, 0), "cudaHostGetDevicePointer");
    peer_word = reinterpret_cast<CUdeviceptr>(
        &static_cast<Shared*>(device_shared)->arrived[peer]);
    barrier();
    check(cudaIpcOpenMemHandle(&peer_landing, shared->landing[peer],
                               cudaIpcMemLazyEnablePeerAccess),
          "cudaIpcOpenMemHandle");
    check(cudaIpcOpenEventHandle(&peer_filled, shared->filled[peer]), "cudaIpcOpenEventHandle");
  }

  void send(Variant variant, const void* from, size_t bytes, uint32_t sequence) {
    check(cudaEventRecord(ready, compute), "record ready");
    check(cudaStreamWaitEvent(copy, ready, 0), "wait ready");
    if (variant == kKernel) {
      const size_t count = bytes / sizeof(uint4);
      copy_and_signal<<<1, 512, 0, copy>>>(
          static_cast<const uint4*>(from), static_cast<uint4*>(peer_landing), count,
          reinterpret_cast<volatile uint32_t*>(peer_word), sequence);
      check(cudaGetLastError(), "kernel launch");
      return;
    }
    check(cudaMemcpyAsync(peer_landing, from, bytes, cudaMemcpyDeviceToDevice, copy), "P2P copy");
    switch (variant) {
      case kCurrent:
      case kWaitOnly:
        check(cudaEventRecord(peer_filled, copy), "record IPC event");
        __atomic_store_n(&shared->arrived[peer], sequence, __ATOMIC_RELEASE);
        break;
      case kSenderSync:
      case kSenderSyncCopy:
        check(cudaEventRecord(done, copy), "record done");
        check(cudaEventSynchronize(done), "sync done");
        __atomic_store_n(&shared->arrived[peer], sequence, __ATOMIC_RELEASE);
        break;
      default:
        check(cuStreamWriteValue32(copy, peer_word, sequence, 0), "cuStreamWriteValue32");
        break;
    }
  }

  // Returns the buffer that holds the message once it is usable on `compute`.
  const void* receive(Variant variant, size_t bytes, uint32_t sequence) {
    spin_until(&shared->arrived[self], sequence);
    switch (variant) {
      case kCurrent:
        check(cudaStreamWaitEvent(copy, filled, 0), "wait IPC event");
        check(cudaMemcpyAsync(out, landing, bytes, cudaMemcpyDeviceToDevice, copy), "copy out");
        check(cudaEventRecord(done, copy), "record done");
        check(cudaEventSynchronize(done), "sync done");
        return out;
      case kWaitOnly:
        check(cudaStreamWaitEvent(copy, filled, 0), "wait IPC event");
        check(cudaEventRecord(done, copy), "record done");
        check(cudaEventSynchronize(done), "sync done");
        return landing;
      case kSenderSyncCopy:
      case kWriteValueCopy:
        check(cudaMemcpyAsync(out, landing, bytes, cudaMemcpyDeviceToDevice, copy), "copy out");
        check(cudaEventRecord(done, copy), "record done");
        check(cudaEventSynchronize(done), "sync done");
        return out;
      case kWriteValueAsync:
        check(cudaMemcpyAsync(out, landing, bytes, cudaMemcpyDeviceToDevice, copy), "copy out");
        check(cudaEventRecord(done, copy), "record done");
        check(cudaStreamWaitEvent(compute, done, 0), "compute waits for the copy-out");
        return out;
      default:
        return landing;
    }
  }

  double ping_pong(Variant variant, size_t bytes, int round_trips) {
    const int warmup = 100;
    uint32_t sequence = ++calls * 1000000u;
    // Both sides start from the same base; the peer writes my word only after the barrier.
    __atomic_store_n(&shared->arrived[self], sequence, __ATOMIC_RELEASE);
    barrier();
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < warmup + round_trips; ++i) {
      if (i == warmup) {
        check(cudaStreamSynchronize(compute), "sync");
        start = std::chrono::steady_clock::now();
      }
      ++sequence;
      if (self == 0) {
        send(variant, source, bytes, sequence);
        receive(variant, bytes, sequence);
      } else {
        const void* received = receive(variant, bytes, sequence);
        send(variant, received, bytes, sequence);
      }
    }
    check(cudaStreamSynchronize(compute), "sync");
    check(cudaStreamSynchronize(copy), "sync");
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    barrier();
    return seconds / round_trips / 2 * 1e6;
  }

  void barrier() {
    ++generation;
    __atomic_store_n(&shared->ready[self], generation, __ATOMIC_RELEASE);
    while (__atomic_load_n(&shared->ready[peer], __ATOMIC_ACQUIRE) < generation) usleep(10);
  }
};

double single_op(const char* name, int repeats, void (*op)(cudaStream_t, void*, void*, size_t),
                 cudaStream_t stream, void* a, void* b, size_t bytes) {
  for (int i = 0; i < 100; ++i) op(stream, a, b, bytes);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < repeats; ++i) op(stream, a, b, bytes);
  const double us = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() /
                    repeats * 1e6;
  std::printf("  %-34s %8zu B %8.2f us\n", name, bytes, us);
  return us;
}

__global__ void empty_kernel() {}

void baselines(int repeats) {
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  void *a, *b, *peer;
  check(cudaMalloc(&a, 1 << 20), "malloc");
  check(cudaMalloc(&b, 1 << 20), "malloc");
  check(cudaSetDevice(1), "cudaSetDevice");
  check(cudaMalloc(&peer, 1 << 20), "malloc");
  check(cudaSetDevice(0), "cudaSetDevice");
  check(cudaDeviceEnablePeerAccess(1, 0), "cudaDeviceEnablePeerAccess");
  std::printf("single process, device 0, each op then cudaStreamSynchronize:\n");
  single_op("nothing (sync only)", repeats,
            [](cudaStream_t s, void*, void*, size_t) { check(cudaStreamSynchronize(s), "s"); },
            stream, a, b, 0);
  single_op("empty kernel", repeats,
            [](cudaStream_t s, void*, void*, size_t) {
              empty_kernel<<<1, 1, 0, s>>>();
              check(cudaStreamSynchronize(s), "s");
            },
            stream, a, b, 0);
  for (size_t bytes : {size_t(4096), size_t(65536)}) {
    single_op("cudaMemcpyAsync D2D local", repeats,
              [](cudaStream_t s, void* x, void* y, size_t n) {
                check(cudaMemcpyAsync(y, x, n, cudaMemcpyDeviceToDevice, s), "c");
                check(cudaStreamSynchronize(s), "s");
              },
              stream, a, b, bytes);
    single_op("cudaMemcpyAsync D2D peer (NVLink)", repeats,
              [](cudaStream_t s, void* x, void* y, size_t n) {
                check(cudaMemcpyAsync(y, x, n, cudaMemcpyDeviceToDevice, s), "c");
                check(cudaStreamSynchronize(s), "s");
              },
              stream, a, peer, bytes);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int round_trips = argc > 1 ? std::atoi(argv[1]) : 2000;
  auto* shared = static_cast<Shared*>(mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE,
                                           MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  std::memset(shared, 0, sizeof(Shared));
  pid_t children[2];
  for (int p = 0; p < 2; ++p) {
    children[p] = fork();
    if (children[p] != 0) continue;
    try {
      check(cuInit(0), "cuInit");
      Process process;
      process.self = p;
      process.peer = 1 - p;
      process.shared = shared;
      process.setup();
      if (p == 0) std::printf("two processes, ping-pong, us one way:\n");
      for (size_t bytes : {size_t(4096), size_t(16384), size_t(65536)}) {
        for (int v = 0; v < kVariants; ++v) {
          const double us = process.ping_pong(static_cast<Variant>(v), bytes, round_trips);
          if (p == 0) std::printf("  %-24s %8zu B %8.2f us\n", kNames[v], bytes, us);
        }
      }
      std::fflush(stdout);
      _exit(0);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "process %d: %s\n", p, error.what());
      _exit(1);
    }
  }
  int failed = 0;
  for (pid_t child : children) {
    int status = 0;
    waitpid(child, &status, 0);
    failed |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (failed) return 1;
  check(cuInit(0), "cuInit");
  baselines(round_trips);
  return 0;
}
