// Python bindings of the RDMA channel end (built only with DPP_WITH_RDMA).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "rdma.h"

namespace py = pybind11;

namespace dpp {

void bind_rdma(py::module_& m) {
  m.def("rdma_devices", &rdma_device_names, "Names of the RDMA devices ibverbs sees");
  py::class_<RdmaChannel>(m, "RdmaChannel")
      .def(py::init([](const std::string& device, int port, int gid_index, bool sender,
                       uint32_t slots, uint64_t slot_bytes, int self_rank, int peer_rank,
                       double timeout_s) {
             ChannelSettings settings;
             settings.self_rank = self_rank;
             settings.peer_rank = peer_rank;
             settings.timeout_s = timeout_s;
             return new RdmaChannel(device, static_cast<uint8_t>(port), gid_index, sender, slots,
                                    slot_bytes, settings);
           }),
           py::arg("device"), py::arg("port"), py::arg("gid_index"), py::arg("sender"),
           py::arg("slots"), py::arg("slot_bytes"), py::arg("self_rank"), py::arg("peer_rank"),
           py::arg("timeout"))
      .def("local_info", [](const RdmaChannel& self) { return py::bytes(self.local_info()); })
      .def("connect", &RdmaChannel::connect, py::arg("remote_info"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "send",
          [](RdmaChannel& self, int kind, int chunk, int microbatch, int dtype,
             std::vector<int64_t> shape, uintptr_t address, uint64_t nbytes) {
            py::gil_scoped_release unlocked;
            self.send(MessageMeta{kind, chunk, microbatch, dtype, std::move(shape), nbytes, false},
                      reinterpret_cast<const void*>(address));
          },
          py::arg("kind"), py::arg("chunk"), py::arg("microbatch"), py::arg("dtype"),
          py::arg("shape"), py::arg("address"), py::arg("nbytes"))
      .def("next",
           [](RdmaChannel& self) -> py::object {
             std::optional<MessageMeta> message;
             {
               py::gil_scoped_release unlocked;
               message = self.next();
             }
             if (!message) return py::none();
             return py::make_tuple(message->kind, message->chunk, message->microbatch,
                                   message->dtype, py::tuple(py::cast(message->shape)),
                                   message->nbytes, false);
           })
      .def(
          "read_into",
          [](RdmaChannel& self, uintptr_t address, uint64_t nbytes) {
            return self.read_into(reinterpret_cast<void*>(address), nbytes);
          },
          py::arg("address"), py::arg("nbytes"), py::call_guard<py::gil_scoped_release>())
      .def("interrupt", &RdmaChannel::interrupt)
      .def("close", &RdmaChannel::close, py::call_guard<py::gil_scoped_release>());
}

}  // namespace dpp
