"""The ibverbs RDMA channel of the native transport. It must compile wherever the rdma-core
headers are installed; the loopback exchange needs an RDMA device."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from megatron.dpp.transport import native

VERBS_HEADER = "/usr/include/infiniband/verbs.h"


def rdma_devices() -> list[str]:
    if not native.build_info()["rdma"]:
        return []
    return list(native.module().rdma_devices())


@pytest.mark.skipif(not native.available(), reason="native transport extension not built")
@pytest.mark.skipif(os.environ.get("DPP_NO_RDMA") == "1", reason="DPP_NO_RDMA=1 set")
def test_rdma_part_is_built_where_the_verbs_headers_are():
    assert native.build_info()["rdma"] == os.path.exists(VERBS_HEADER)


@pytest.mark.skipif(not rdma_devices(), reason="no RDMA device (ibv_get_device_list is empty)")
def test_loopback_exchange_of_fragmented_messages():
    extension = native.module()
    device = rdma_devices()[0]
    gid_index = int(os.environ.get("DPP_RDMA_GID_INDEX", "0"))
    ends = [extension.RdmaChannel(device, 1, gid_index, sender, 4, 8192, rank, 1 - rank, 10.0)
            for rank, sender in ((0, True), (1, False))]
    sender, receiver = ends
    infos = [end.local_info() for end in ends]
    sender.connect(infos[1])
    receiver.connect(infos[0])
    messages = [torch.randn(size, generator=torch.Generator().manual_seed(size))
                for size in (1, 1000, 2048, 5000, 30_000)]

    def send_all():
        for index, tensor in enumerate(messages):
            sender.send(0, 0, index, 0, list(tensor.shape), tensor.data_ptr(),
                        tensor.numel() * 4)
        sender.close()

    thread = threading.Thread(target=send_all)
    thread.start()
    for index, expected in enumerate(messages):
        kind, chunk, microbatch, dtype, shape, nbytes, _ = receiver.next()
        assert (kind, chunk, microbatch, dtype) == (0, 0, index, 0)
        got = torch.empty(shape)
        assert receiver.read_into(got.data_ptr(), nbytes)
        assert torch.equal(got, expected)
    assert receiver.next() is None
    thread.join()
    receiver.close()
