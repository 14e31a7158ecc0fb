// ibverbs RDMA channel ends (RC queue pairs) for pipeline edges that cross nodes.
// Built only where libibverbs headers exist (DPP_WITH_RDMA).
//
// Wire protocol: the receiver owns `slots` registered slots; the sender RDMA-writes a
// fragment (wire header + payload) into slot `sequence % slots` with the slot index as
// immediate data, which consumes a receive request there. Each freed slot goes back to
// the sender as a credit (a SEND with immediate), so the sender never overruns the ring.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shm_channel.h"

namespace dpp {

std::vector<std::string> rdma_device_names();

// Turns a verbs return code into an exception naming the operation.
void verbs_check(int status, const std::string& operation);

class VerbsContext {
 public:
  explicit VerbsContext(const std::string& device_name);
  VerbsContext(const VerbsContext&) = delete;
  VerbsContext& operator=(const VerbsContext&) = delete;
  ~VerbsContext();
  ibv_context* context() const { return context_; }
  ibv_pd* protection_domain() const { return domain_; }

 private:
  ibv_context* context_ = nullptr;
  ibv_pd* domain_ = nullptr;
};

// A page-aligned host buffer registered for local and remote writes.
class MemoryRegion {
 public:
  MemoryRegion(const VerbsContext& verbs, size_t bytes);
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  ~MemoryRegion();
  unsigned char* data() const { return data_; }
  size_t size() const { return bytes_; }
  uint32_t lkey() const { return region_->lkey; }
  uint32_t rkey() const { return region_->rkey; }

 private:
  unsigned char* data_ = nullptr;
  size_t bytes_ = 0;
  ibv_mr* region_ = nullptr;
};

// A completion queue with a completion channel, so waiting sleeps in poll(2).
class CompletionQueue {
 public:
  CompletionQueue(const VerbsContext& verbs, int depth);
  CompletionQueue(const CompletionQueue&) = delete;
  CompletionQueue& operator=(const CompletionQueue&) = delete;
  ~CompletionQueue();
  ibv_cq* get() const { return queue_; }
  // Next completion; waits up to `timeout` (then nullopt). Throws on an error status.
  std::optional<ibv_wc> next(std::chrono::milliseconds timeout);

 private:
  ibv_comp_channel* channel_ = nullptr;
  ibv_cq* queue_ = nullptr;
  unsigned unacknowledged_ = 0;
};

// What one end tells the other to connect (exchanged as bytes through the torch store).
struct EndpointInfo {
  uint32_t qp_num;
  uint16_t lid;
  uint8_t port;
  uint8_t mtu;
  uint8_t gid[16];
  uint64_t address;  // receiver: base of its slot region
  uint32_t rkey;
  uint32_t slots;
  uint64_t slot_bytes;
};

class QueuePair {
 public:
  QueuePair(const VerbsContext& verbs, const CompletionQueue& queue, int depth);
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;
  ~QueuePair();
  uint32_t number() const { return pair_->qp_num; }
  // INIT -> RTR -> RTS against `remote`, with retry and timeout counts set.
  void connect(uint8_t port, int gid_index, const EndpointInfo& remote);
  void post_receive(uint64_t id);
  void post_write_with_immediate(uint64_t id, const MemoryRegion& local, size_t offset,
                                 size_t bytes, uint64_t remote_address, uint32_t rkey,
                                 uint32_t immediate);
  void post_send_immediate(uint64_t id, uint32_t immediate);

 private:
  ibv_qp* pair_ = nullptr;
};

// Wire header in front of each fragment's payload inside a slot.
struct alignas(64) RdmaFragmentHeader {
  uint32_t flags;
  int32_t kind, chunk, microbatch, dtype, ndim;
  int64_t shape[kMaxDims];
  uint64_t total_bytes, offset, bytes;
};

class RdmaChannel {
 public:
  // `sender` picks the end; `gid_index` < 0 uses the LID only (InfiniBand).
  RdmaChannel(const std::string& device_name, uint8_t port, int gid_index, bool sender,
              uint32_t slots, uint64_t slot_bytes, const ChannelSettings& settings);
  RdmaChannel(const RdmaChannel&) = delete;
  RdmaChannel& operator=(const RdmaChannel&) = delete;
  ~RdmaChannel();

  std::string local_info() const;
  void connect(const std::string& remote_info);

  void send(const MessageMeta& meta, const void* source);
  void close();
  std::optional<MessageMeta> next();
  bool read_into(void* destination, uint64_t nbytes);
  void interrupt() { stop_.store(true); }

 private:
  size_t stride() const { return sizeof(RdmaFragmentHeader) + slot_bytes_; }
  // Processes completions until `ready()`; bounded unless `idle`.
  template <typename Ready>
  bool wait(Ready ready, bool idle, const char* what);
  void handle(const ibv_wc& completion);
  void send_fragment(const MessageMeta& meta, const unsigned char* payload, uint64_t offset,
                     uint64_t bytes, uint32_t flags);
  // Receiver: re-arms the slot of `sequence` and returns it to the sender as a credit.
  void recycle(uint64_t sequence);
  const RdmaFragmentHeader* header_of(uint64_t sequence) const {
    return reinterpret_cast<const RdmaFragmentHeader*>(region_.data() +
                                                       (sequence % slots_) * stride());
  }

  ChannelSettings settings_;
  bool sender_;
  uint8_t port_;
  int gid_index_;
  uint32_t slots_;
  uint64_t slot_bytes_;
  VerbsContext verbs_;
  MemoryRegion region_;
  CompletionQueue queue_;
  QueuePair pair_;
  EndpointInfo remote_{};
  bool connected_ = false;
  std::atomic<bool> stop_{false};
  uint64_t sequence_ = 0;
  uint32_t credits_ = 0;             // sender: free receiver slots
  uint64_t writes_completed_ = 0;    // sender: local slots reusable up to this count
  uint64_t arrived_ = 0;             // receiver: fragments landed (in order)
  uint32_t credit_sends_ = 0;        // receiver: credit SENDs not yet completed
  uint8_t local_mtu_ = IBV_MTU_1024;
  bool closed_ = false;
  MessageMeta current_;
  bool in_message_ = false;
};

}  // namespace dpp
