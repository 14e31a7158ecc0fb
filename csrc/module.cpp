// Python bindings of the native transport: megatron.dpp._native.
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "errors.h"
#include "mailbox.h"
#include "shm_channel.h"
#include "shm_drain.h"

#ifdef DPP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;

#ifdef DPP_WITH_RDMA
namespace dpp {
void bind_rdma(py::module_& m);  // bindings_rdma.cpp
}
#endif
using dpp::ChannelSettings;
using dpp::Mailbox;
using dpp::MailboxKey;
using dpp::MessageMeta;
using dpp::ShmReceiver;
using dpp::ShmDrain;
using dpp::ShmSender;

namespace {

ChannelSettings settings(int self_rank, int peer_rank, double timeout_s, double spin_us) {
  if (timeout_s <= 0) throw dpp::TransportFailure("channel timeout must be > 0 s");
  ChannelSettings result;
  result.self_rank = self_rank;
  result.peer_rank = peer_rank;
  result.timeout_s = timeout_s;
  result.spin_us = spin_us < 0 ? 0 : spin_us;
  return result;
}

MessageMeta meta(int kind, int chunk, int microbatch, int dtype, std::vector<int64_t> shape,
                 uint64_t nbytes, bool on_cuda) {
  return MessageMeta{kind, chunk, microbatch, dtype, std::move(shape), nbytes, on_cuda};
}

void* pointer(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Sends a contiguous GPU tensor written on this thread's current stream; resolving the
// stream and recording the copy stream here saves the Python calls on the latency path.
void send_cuda_tensor(ShmSender& sender, MessageMeta meta, const at::Tensor& tensor,
                      uintptr_t copy_stream) {
#ifdef DPP_WITH_CUDA
  if (!tensor.is_cuda() || !tensor.is_contiguous()) {
    throw dpp::TransportFailure("send_cuda needs a contiguous CUDA tensor");
  }
  const c10::DeviceIndex device = tensor.device().index();
  const uintptr_t producer =
      reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(device).stream());
  {
    py::gil_scoped_release unlocked;
    sender.send_cuda(meta, tensor.data_ptr(), producer, copy_stream);
  }
  // The copy may still read the tensor on the side stream after this returns.
  c10::cuda::CUDACachingAllocator::recordStream(
      tensor.storage().data_ptr(),
      c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(copy_stream), device));
#else
  (void)sender;
  (void)meta;
  (void)tensor;
  (void)copy_stream;
  throw dpp::TransportFailure("the native transport was built without CUDA");
#endif
}

py::dict build_info() {
  py::dict info;
  info["shm"] = true;
#ifdef DPP_WITH_CUDA
  info["cuda"] = true;
#else
  info["cuda"] = false;
#endif
#ifdef DPP_WITH_RDMA
  info["rdma"] = true;
#else
  info["rdma"] = false;
#endif
  return info;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "DPP native transport: shared-memory rings, CUDA staging / IPC, ibverbs RDMA";
  // Translators registered later are tried first: the base class goes first.
  auto& transport_error =
      py::register_exception<dpp::TransportFailure>(m, "NativeTransportError", PyExc_RuntimeError);
  py::register_exception<dpp::PeerDied>(m, "PeerDiedError", transport_error.ptr());
  py::register_exception<dpp::WaitTimeout>(m, "WaitTimeoutError", transport_error.ptr());

  m.def("build_info", &build_info, "What this build contains: {'shm', 'cuda', 'rdma'} -> bool");

  py::class_<Mailbox>(m, "Mailbox")
      .def(py::init<double>(), py::arg("spin_us"))
      .def(
          "put",
          [](Mailbox& self, int kind, int chunk, int microbatch, at::Tensor tensor) {
            self.put(MailboxKey{kind, chunk, microbatch}, std::move(tensor));
          },
          py::arg("kind"), py::arg("chunk"), py::arg("microbatch"), py::arg("tensor"))
      .def("fail", &Mailbox::fail, py::arg("message"))
      .def("notify", &Mailbox::notify,
           "Changes the version without a message: a waiter wakes and looks again")
      .def(
          "take",
          [](Mailbox& self, int kind, int chunk, int microbatch) {
            return self.take(MailboxKey{kind, chunk, microbatch});
          },
          "The message's tensor, removed from the mailbox, or None when it has not arrived; a "
          "GPU message makes the current stream wait for its copy first",
          py::arg("kind"), py::arg("chunk"), py::arg("microbatch"))
      .def(
          "has",
          [](const Mailbox& self, int kind, int chunk, int microbatch) {
            return self.has(MailboxKey{kind, chunk, microbatch});
          },
          py::arg("kind"), py::arg("chunk"), py::arg("microbatch"))
      .def(
          "landed",
          [](const Mailbox& self, int kind, int chunk, int microbatch) {
            return self.landed(MailboxKey{kind, chunk, microbatch});
          },
          "The message is here and its data written (a GPU message's copy has finished)",
          py::arg("kind"), py::arg("chunk"), py::arg("microbatch"))
      .def("keys", &Mailbox::keys)
      .def("__len__", &Mailbox::size)
      .def("error", &Mailbox::error, "The first recorded failure, or None")
      .def_property_readonly("version", &Mailbox::version)
      .def("wait", &Mailbox::wait, py::arg("seen"), py::arg("timeout"),
           "Blocks until the version differs from `seen` or a failure is recorded (True), or "
           "`timeout` seconds pass (False)",
           py::call_guard<py::gil_scoped_release>());

  py::class_<ShmReceiver>(m, "ShmReceiver")
      .def(py::init([](const std::string& name, uint32_t slots, uint64_t slot_bytes,
                       int self_rank, int peer_rank, double timeout_s, double spin_us) {
             return new ShmReceiver(name, slots, slot_bytes,
                                    settings(self_rank, peer_rank, timeout_s, spin_us));
           }),
           py::arg("name"), py::arg("slots"), py::arg("slot_bytes"), py::arg("self_rank"),
           py::arg("peer_rank"), py::arg("timeout"), py::arg("spin_us") = 200.0)
      .def("enable_cuda", &ShmReceiver::enable_cuda, py::arg("device"), py::arg("export_pool"),
           py::arg("device_slot_bytes"), py::call_guard<py::gil_scoped_release>())
      .def("interrupt", &ShmReceiver::interrupt, py::call_guard<py::gil_scoped_release>())
      .def("close", &ShmReceiver::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("sender_pid", &ShmReceiver::sender_pid)
      .def_property_readonly("name", &ShmReceiver::name);

  py::class_<ShmDrain>(m, "ShmDrain")
      .def(py::init<ShmReceiver&, Mailbox&, std::string, int, uintptr_t, uintptr_t>(),
           py::arg("receiver"), py::arg("mailbox"), py::arg("label"), py::arg("device"),
           py::arg("copy_stream"), py::arg("consumer_stream"),
           // the thread uses both for as long as the drain lives
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def("join", &ShmDrain::join, py::call_guard<py::gil_scoped_release>());

  py::class_<ShmSender>(m, "ShmSender")
      .def(py::init([](const std::string& name, int self_rank, int peer_rank, double timeout_s,
                       double spin_us) {
             return new ShmSender(name, settings(self_rank, peer_rank, timeout_s, spin_us));
           }),
           py::arg("name"), py::arg("self_rank"), py::arg("peer_rank"), py::arg("timeout"),
           py::arg("spin_us") = 200.0)
      .def(
          "send",
          [](ShmSender& self, int kind, int chunk, int microbatch, int dtype,
             std::vector<int64_t> shape, uintptr_t address, uint64_t nbytes) {
            py::gil_scoped_release unlocked;
            self.send(meta(kind, chunk, microbatch, dtype, std::move(shape), nbytes, false),
                      pointer(address));
          },
          py::arg("kind"), py::arg("chunk"), py::arg("microbatch"), py::arg("dtype"),
          py::arg("shape"), py::arg("address"), py::arg("nbytes"))
      .def(
          "send_cuda",
          [](ShmSender& self, int kind, int chunk, int microbatch, int dtype,
             const at::Tensor& tensor, uintptr_t copy_stream) {
            send_cuda_tensor(self,
                             meta(kind, chunk, microbatch, dtype, tensor.sizes().vec(),
                                  tensor.nbytes(), true),
                             tensor, copy_stream);
          },
          py::arg("kind"), py::arg("chunk"), py::arg("microbatch"), py::arg("dtype"),
          py::arg("tensor"), py::arg("copy_stream"),
          "Sends a contiguous GPU tensor produced on the current stream; copies on "
          "`copy_stream` (a CUDA stream handle)")
      .def("enable_cuda", &ShmSender::enable_cuda, py::arg("device"), py::arg("path"),
           py::call_guard<py::gil_scoped_release>())
      .def("close", &ShmSender::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("receiver_pid", &ShmSender::receiver_pid);

#ifdef DPP_WITH_RDMA
  dpp::bind_rdma(m);
#endif
}
