// Owners of the ibverbs objects: device context + protection domain, registered memory,
// completion queue with its channel, and the RC queue pair with its state transitions.
#include <arpa/inet.h>
#include <poll.h>
#include <stdlib.h>

#include <cerrno>
#include <cstring>

#include "errors.h"
#include "rdma.h"

namespace dpp {

void verbs_check(int status, const std::string& operation) {
  if (status != 0) {
    // Verbs calls return an errno value (some also set errno and return -1).
    const int err = status > 0 ? status : errno;
    throw TransportFailure(operation + " failed: " + std::strerror(err) + " (status " +
                           std::to_string(status) + ", errno " + std::to_string(err) + ")");
  }
}

std::vector<std::string> rdma_device_names() {
  int count = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  std::vector<std::string> names;
  if (devices == nullptr) return names;  // no driver loaded: no devices
  for (int i = 0; i < count; ++i) names.emplace_back(ibv_get_device_name(devices[i]));
  ibv_free_device_list(devices);
  return names;
}

VerbsContext::VerbsContext(const std::string& device_name) {
  int count = 0;
  ibv_device** devices = ibv_get_device_list(&count);
  if (devices == nullptr) throw_errno("ibv_get_device_list");
  for (int i = 0; i < count && context_ == nullptr; ++i) {
    if (device_name.empty() || device_name == ibv_get_device_name(devices[i])) {
      context_ = ibv_open_device(devices[i]);
      if (context_ == nullptr) {
        ibv_free_device_list(devices);
        throw_errno("ibv_open_device(" + device_name + ")");
      }
    }
  }
  ibv_free_device_list(devices);
  if (context_ == nullptr) {
    throw TransportFailure("RDMA device '" + device_name + "' not found (" +
                           std::to_string(count) + " devices present)");
  }
  domain_ = ibv_alloc_pd(context_);
  if (domain_ == nullptr) {
    ibv_close_device(context_);
    throw_errno("ibv_alloc_pd");
  }
}

VerbsContext::~VerbsContext() {
  ibv_dealloc_pd(domain_);
  ibv_close_device(context_);
}

MemoryRegion::MemoryRegion(const VerbsContext& verbs, size_t bytes) : bytes_(bytes) {
  void* data = nullptr;
  const int status = ::posix_memalign(&data, 4096, bytes);
  if (status != 0) verbs_check(status, "posix_memalign of " + std::to_string(bytes) + " bytes");
  data_ = static_cast<unsigned char*>(data);
  std::memset(data_, 0, bytes);
  region_ = ibv_reg_mr(verbs.protection_domain(), data_, bytes,
                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (region_ == nullptr) {
    const int err = errno;
    ::free(data_);
    errno = err;
    throw_errno("ibv_reg_mr of " + std::to_string(bytes) + " bytes");
  }
}

MemoryRegion::~MemoryRegion() {
  ibv_dereg_mr(region_);
  ::free(data_);
}

CompletionQueue::CompletionQueue(const VerbsContext& verbs, int depth) {
  channel_ = ibv_create_comp_channel(verbs.context());
  if (channel_ == nullptr) throw_errno("ibv_create_comp_channel");
  queue_ = ibv_create_cq(verbs.context(), depth, nullptr, channel_, 0);
  if (queue_ == nullptr) {
    const int err = errno;
    ibv_destroy_comp_channel(channel_);
    errno = err;
    throw_errno("ibv_create_cq");
  }
}

CompletionQueue::~CompletionQueue() {
  if (unacknowledged_ > 0) ibv_ack_cq_events(queue_, unacknowledged_);
  ibv_destroy_cq(queue_);
  ibv_destroy_comp_channel(channel_);
}

std::optional<ibv_wc> CompletionQueue::next(std::chrono::milliseconds timeout) {
  ibv_wc completion{};
  auto poll_once = [&]() -> bool {
    const int found = ibv_poll_cq(queue_, 1, &completion);
    if (found < 0) verbs_check(found, "ibv_poll_cq");
    if (found == 0) return false;
    if (completion.status != IBV_WC_SUCCESS) {
      throw TransportFailure(std::string("RDMA work completion failed: ") +
                             ibv_wc_status_str(completion.status) + " (opcode " +
                             std::to_string(completion.opcode) + ", vendor error " +
                             std::to_string(completion.vendor_err) + ")");
    }
    return true;
  };
  if (poll_once()) return completion;
  verbs_check(ibv_req_notify_cq(queue_, 0), "ibv_req_notify_cq");
  if (poll_once()) return completion;  // arrived between the poll and the arming
  struct pollfd watch {channel_->fd, POLLIN, 0};
  const int ready = ::poll(&watch, 1, static_cast<int>(timeout.count()));
  if (ready < 0 && errno != EINTR) throw_errno("poll on the RDMA completion channel");
  if (ready > 0) {
    ibv_cq* queue = nullptr;
    void* context = nullptr;
    verbs_check(ibv_get_cq_event(channel_, &queue, &context), "ibv_get_cq_event");
    if (++unacknowledged_ >= 64) {
      ibv_ack_cq_events(queue_, unacknowledged_);
      unacknowledged_ = 0;
    }
  }
  if (poll_once()) return completion;
  return std::nullopt;
}

QueuePair::QueuePair(const VerbsContext& verbs, const CompletionQueue& queue, int depth) {
  ibv_qp_init_attr attributes{};
  attributes.send_cq = queue.get();
  attributes.recv_cq = queue.get();
  attributes.qp_type = IBV_QPT_RC;
  attributes.cap.max_send_wr = depth;
  attributes.cap.max_recv_wr = depth;
  attributes.cap.max_send_sge = 1;
  attributes.cap.max_recv_sge = 1;
  pair_ = ibv_create_qp(verbs.protection_domain(), &attributes);
  if (pair_ == nullptr) throw_errno("ibv_create_qp (RC)");
}

QueuePair::~QueuePair() { ibv_destroy_qp(pair_); }

void QueuePair::connect(uint8_t port, int gid_index, const EndpointInfo& remote) {
  ibv_qp_attr init{};
  init.qp_state = IBV_QPS_INIT;
  init.pkey_index = 0;
  init.port_num = port;
  init.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  verbs_check(ibv_modify_qp(pair_, &init,
                            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
              "ibv_modify_qp to INIT");

  ibv_qp_attr ready{};
  ready.qp_state = IBV_QPS_RTR;
  ready.path_mtu = static_cast<ibv_mtu>(remote.mtu);
  ready.dest_qp_num = remote.qp_num;
  ready.rq_psn = 0;
  ready.max_dest_rd_atomic = 1;
  ready.min_rnr_timer = 12;
  ready.ah_attr.dlid = remote.lid;
  ready.ah_attr.port_num = port;
  if (gid_index >= 0) {
    ready.ah_attr.is_global = 1;
    std::memcpy(ready.ah_attr.grh.dgid.raw, remote.gid, sizeof(remote.gid));
    ready.ah_attr.grh.sgid_index = static_cast<uint8_t>(gid_index);
    ready.ah_attr.grh.hop_limit = 1;
  }
  verbs_check(ibv_modify_qp(pair_, &ready,
                            IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                IBV_QP_MIN_RNR_TIMER),
              "ibv_modify_qp to RTR");

  ibv_qp_attr send{};
  send.qp_state = IBV_QPS_RTS;
  send.timeout = 14;   // 4.096 us * 2^14 = 67 ms per attempt
  send.retry_cnt = 7;  // transport retries before the QP errors out
  send.rnr_retry = 7;  // receiver-not-ready retries: 7 = retry forever
  send.sq_psn = 0;
  send.max_rd_atomic = 1;
  verbs_check(ibv_modify_qp(pair_, &send,
                            IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC),
              "ibv_modify_qp to RTS");
}

void QueuePair::post_receive(uint64_t id) {
  ibv_recv_wr request{};
  ibv_recv_wr* bad = nullptr;
  request.wr_id = id;
  verbs_check(ibv_post_recv(pair_, &request, &bad), "ibv_post_recv");
}

void QueuePair::post_write_with_immediate(uint64_t id, const MemoryRegion& local, size_t offset,
                                          size_t bytes, uint64_t remote_address, uint32_t rkey,
                                          uint32_t immediate) {
  ibv_sge piece{};
  piece.addr = reinterpret_cast<uint64_t>(local.data() + offset);
  piece.length = static_cast<uint32_t>(bytes);
  piece.lkey = local.lkey();
  ibv_send_wr request{};
  ibv_send_wr* bad = nullptr;
  request.wr_id = id;
  request.sg_list = &piece;
  request.num_sge = 1;
  request.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  request.send_flags = IBV_SEND_SIGNALED;
  request.imm_data = htonl(immediate);
  request.wr.rdma.remote_addr = remote_address;
  request.wr.rdma.rkey = rkey;
  verbs_check(ibv_post_send(pair_, &request, &bad), "ibv_post_send (RDMA write with immediate)");
}

void QueuePair::post_send_immediate(uint64_t id, uint32_t immediate) {
  ibv_send_wr request{};
  ibv_send_wr* bad = nullptr;
  request.wr_id = id;
  request.opcode = IBV_WR_SEND_WITH_IMM;
  request.send_flags = IBV_SEND_SIGNALED;
  request.imm_data = htonl(immediate);
  verbs_check(ibv_post_send(pair_, &request, &bad), "ibv_post_send (credit)");
}

}  // namespace dpp
