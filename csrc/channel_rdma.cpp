// One end of an RDMA channel: credit-based slot ring over an RC queue pair (see rdma.h).
#include <arpa/inet.h>

#include <algorithm>
#include <cstring>

#include "errors.h"
#include "rdma.h"

namespace dpp {

namespace {

constexpr auto kTick = std::chrono::milliseconds(50);
constexpr uint64_t kCreditRequest = ~0ull;

}  // namespace

RdmaChannel::RdmaChannel(const std::string& device_name, uint8_t port, int gid_index,
                         bool sender, uint32_t slots, uint64_t slot_bytes,
                         const ChannelSettings& settings)
    : settings_(settings),
      sender_(sender),
      port_(port),
      gid_index_(gid_index),
      slots_(slots),
      slot_bytes_(slot_bytes),
      verbs_(device_name),
      region_(verbs_, static_cast<size_t>(slots) * (sizeof(RdmaFragmentHeader) + slot_bytes)),
      queue_(verbs_, static_cast<int>(2 * slots + 8)),
      pair_(verbs_, queue_, static_cast<int>(2 * slots + 8)) {
  if (slots < 2) throw TransportFailure("an RDMA ring needs at least 2 slots");
}

RdmaChannel::~RdmaChannel() = default;

std::string RdmaChannel::local_info() const {
  ibv_port_attr port{};
  verbs_check(ibv_query_port(verbs_.context(), port_, &port), "ibv_query_port");
  EndpointInfo info{};
  info.qp_num = pair_.number();
  info.lid = port.lid;
  info.port = port_;
  info.mtu = static_cast<uint8_t>(port.active_mtu);
  if (gid_index_ >= 0) {
    ibv_gid gid{};
    verbs_check(ibv_query_gid(verbs_.context(), port_, gid_index_, &gid), "ibv_query_gid");
    std::memcpy(info.gid, gid.raw, sizeof(info.gid));
  }
  info.address = reinterpret_cast<uint64_t>(region_.data());
  info.rkey = region_.rkey();
  info.slots = slots_;
  info.slot_bytes = slot_bytes_;
  return std::string(reinterpret_cast<const char*>(&info), sizeof(info));
}

void RdmaChannel::connect(const std::string& remote_info) {
  if (connected_) throw TransportFailure("RDMA channel connected twice");
  if (remote_info.size() != sizeof(EndpointInfo)) {
    throw TransportFailure("RDMA endpoint info of " + std::to_string(remote_info.size()) +
                           " bytes, expected " + std::to_string(sizeof(EndpointInfo)));
  }
  std::memcpy(&remote_, remote_info.data(), sizeof(remote_));
  if (remote_.slots != slots_ || remote_.slot_bytes != slot_bytes_) {
    throw TransportFailure("RDMA peer rank " + std::to_string(settings_.peer_rank) + " uses " +
                           std::to_string(remote_.slots) + " slots of " +
                           std::to_string(remote_.slot_bytes) + " bytes, this end " +
                           std::to_string(slots_) + " of " + std::to_string(slot_bytes_));
  }
  ibv_port_attr port{};
  verbs_check(ibv_query_port(verbs_.context(), port_, &port), "ibv_query_port");
  EndpointInfo path = remote_;
  path.mtu = std::min<uint8_t>(remote_.mtu, static_cast<uint8_t>(port.active_mtu));
  // Receive requests first: data (receiver) or credits (sender) may land right after RTR.
  for (uint32_t i = 0; i < slots_; ++i) pair_.post_receive(i);
  pair_.connect(port_, gid_index_, path);
  credits_ = sender_ ? slots_ : 0;
  connected_ = true;
}

template <typename Ready>
bool RdmaChannel::wait(Ready ready, bool idle, const char* what) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(settings_.timeout_s));
  while (!ready()) {
    if (stop_.load()) return false;
    if (auto completion = queue_.next(kTick)) {
      handle(*completion);
      continue;
    }
    if (!idle && Clock::now() >= deadline) {
      throw WaitTimeout("timed out after " + std::to_string(settings_.timeout_s) + " s " + what +
                        " from RDMA peer rank " + std::to_string(settings_.peer_rank));
    }
  }
  return true;
}

void RdmaChannel::handle(const ibv_wc& completion) {
  switch (completion.opcode) {
    case IBV_WC_RDMA_WRITE:
      ++writes_completed_;
      break;
    case IBV_WC_RECV:  // sender: a credit
      credits_ += ntohl(completion.imm_data);
      pair_.post_receive(completion.wr_id);
      break;
    case IBV_WC_RECV_RDMA_WITH_IMM:  // receiver: a fragment landed (RC keeps the order)
      ++arrived_;
      break;
    case IBV_WC_SEND:
      --credit_sends_;
      break;
    default:
      throw TransportFailure("unexpected RDMA completion opcode " +
                             std::to_string(completion.opcode));
  }
}

void RdmaChannel::send_fragment(const MessageMeta& meta, const unsigned char* payload,
                                uint64_t offset, uint64_t bytes, uint32_t flags) {
  if (!wait([&] { return credits_ > 0 && sequence_ - writes_completed_ < slots_; }, false,
            "waiting for a credit")) {
    // Interrupted: writing without a credit could overwrite a slot the peer still reads.
    throw TransportFailure("RDMA send interrupted while waiting for a credit");
  }
  const size_t at = (sequence_ % slots_) * stride();
  auto* header = reinterpret_cast<RdmaFragmentHeader*>(region_.data() + at);
  header->flags = flags;
  header->kind = meta.kind;
  header->chunk = meta.chunk;
  header->microbatch = meta.microbatch;
  header->dtype = meta.dtype;
  header->ndim = static_cast<int32_t>(meta.shape.size());
  std::copy(meta.shape.begin(), meta.shape.end(), header->shape);
  header->total_bytes = meta.nbytes;
  header->offset = offset;
  header->bytes = bytes;
  if (bytes > 0) std::memcpy(region_.data() + at + sizeof(RdmaFragmentHeader), payload, bytes);
  pair_.post_write_with_immediate(sequence_, region_, at, sizeof(RdmaFragmentHeader) + bytes,
                                  remote_.address + at, remote_.rkey,
                                  static_cast<uint32_t>(sequence_ % slots_));
  --credits_;
  ++sequence_;
}

void RdmaChannel::send(const MessageMeta& meta, const void* source) {
  if (!sender_ || !connected_ || closed_) {
    throw TransportFailure("send on an RDMA channel end that is not an open sender");
  }
  if (meta.shape.size() > static_cast<size_t>(kMaxDims)) {
    throw TransportFailure("tensor of more than " + std::to_string(kMaxDims) + " dimensions");
  }
  const auto* in = static_cast<const unsigned char*>(source);
  uint64_t offset = 0;
  do {
    const uint64_t bytes = std::min<uint64_t>(slot_bytes_, meta.nbytes - offset);
    send_fragment(meta, in + offset, offset, bytes,
                  (offset == 0 ? kFragmentFirst : 0u) |
                      (offset + bytes == meta.nbytes ? kFragmentLast : 0u));
    offset += bytes;
  } while (offset < meta.nbytes);
}

void RdmaChannel::close() {
  if (closed_) return;
  closed_ = true;
  if (sender_ && connected_) {
    send_fragment(MessageMeta{}, nullptr, 0, 0, kChannelClosed);
    wait([&] { return writes_completed_ == sequence_; }, false, "flushing writes");
  }
}

void RdmaChannel::recycle(uint64_t sequence) {
  wait([&] { return credit_sends_ < slots_; }, false, "waiting for credit sends to complete");
  pair_.post_receive(sequence % slots_);
  pair_.post_send_immediate(kCreditRequest, 1);
  ++credit_sends_;
}

std::optional<MessageMeta> RdmaChannel::next() {
  if (sender_ || !connected_) throw TransportFailure("next() on an RDMA end that is no receiver");
  if (in_message_) throw TransportFailure("next() before the previous message was read");
  if (!wait([&] { return arrived_ > sequence_; }, true, "waiting for the next message")) {
    return std::nullopt;
  }
  const RdmaFragmentHeader* header = header_of(sequence_);
  if (header->flags & kChannelClosed) {
    recycle(sequence_++);
    return std::nullopt;
  }
  if (!(header->flags & kFragmentFirst) || header->ndim < 0 || header->ndim > kMaxDims) {
    throw TransportFailure("RDMA channel: malformed first fragment");
  }
  current_ = MessageMeta{header->kind, header->chunk, header->microbatch, header->dtype,
                         std::vector<int64_t>(header->shape, header->shape + header->ndim),
                         header->total_bytes, false};
  in_message_ = true;
  return current_;
}

bool RdmaChannel::read_into(void* destination, uint64_t nbytes) {
  if (!in_message_ || nbytes != current_.nbytes) {
    throw TransportFailure("read_into() of " + std::to_string(nbytes) +
                           " bytes without a matching message from next()");
  }
  auto* out = static_cast<unsigned char*>(destination);
  uint64_t offset = 0;
  while (true) {
    if (!wait([&] { return arrived_ > sequence_; }, false, "waiting for the rest of a message")) {
      return false;
    }
    const RdmaFragmentHeader* header = header_of(sequence_);
    if (header->offset != offset || header->offset + header->bytes > nbytes) {
      throw TransportFailure("RDMA channel: fragment out of order");
    }
    std::memcpy(out + offset, reinterpret_cast<const unsigned char*>(header) + sizeof(*header),
                header->bytes);
    offset += header->bytes;
    const bool last = header->flags & kFragmentLast;
    recycle(sequence_++);
    if (last) break;
  }
  in_message_ = false;
  return offset == nbytes;
}

}  // namespace dpp
