"""The pipeline topology: virtual stages, where inputs come from and outputs go, the
transport's edges; no other module of megatron/dpp computes a virtual stage."""

import re

import pytest

from megatron.dpp.actions import BACKWARD, FORWARD, WEIGHT, Task
from megatron.dpp.topology import PipelineTopology
from megatron.dpp.transport.channel import Edge, MessageKind
from megatron.dpp.transport.pipeline import pipeline_edges
from tests import REPO

SHAPES = [(1, 1), (1, 3), (2, 1), (2, 2), (3, 2), (4, 1), (4, 3)]


@pytest.mark.parametrize("p,chunks", SHAPES)
def test_virtual_stages_follow_megatrons_layout(p, chunks):
    topology = PipelineTopology(p, chunks)
    seen = []
    for rank in range(p):
        for chunk in range(chunks):
            v = topology.virtual_stage(rank, chunk)
            assert topology.placement(v) == (rank, chunk)
            assert topology.is_first(rank, chunk) == (v == 0)
            assert topology.is_last(rank, chunk) == (v == p * chunks - 1)
            seen.append(v)
    assert sorted(seen) == list(range(p * chunks))
    # megatron: chunk c of rank r is c * p + r, so rank 0 holds 0, p, 2p, ...
    assert [topology.virtual_stage(0, c) for c in range(chunks)] == list(range(0, p * chunks, p))


@pytest.mark.parametrize("p,chunks", SHAPES)
def test_sources_and_destinations_are_inverse(p, chunks):
    topology = PipelineTopology(p, chunks)
    local = []
    for rank in range(p):
        for chunk in range(chunks):
            for kind in (FORWARD, BACKWARD, WEIGHT):
                task = Task(kind, chunk, 3)
                destination = topology.destination(rank, task)
                if destination is not None:
                    assert topology.source(*destination) == (rank, task)
                    step = 1 if kind == FORWARD else -1
                    assert (topology.virtual_stage(destination[0], destination[1].chunk)
                            == topology.virtual_stage(rank, chunk) + step)
                source = topology.source(rank, task)
                assert topology.input_is_local(rank, task) == (source is None)
                if source is None:
                    local.append((kind, topology.virtual_stage(rank, chunk)))
    last = p * chunks - 1
    expected = [(FORWARD, 0), (BACKWARD, last)] + [(WEIGHT, v) for v in range(last + 1)]
    assert sorted(local) == sorted(expected)
    assert topology.local_predecessor(Task(BACKWARD, 1, 2)) == Task(FORWARD, 1, 2)
    assert topology.local_predecessor(Task(WEIGHT, 1, 2)) == Task(BACKWARD, 1, 2)
    assert topology.local_predecessor(Task(FORWARD, 1, 2)) is None


def test_edges_close_the_ring_with_chunks():
    assert PipelineTopology(3, 1).message_edges() == [
        (0, 1, FORWARD), (1, 0, BACKWARD), (1, 2, FORWARD), (2, 1, BACKWARD)]
    assert PipelineTopology(3, 2).message_edges() == [
        (0, 1, FORWARD), (0, 2, BACKWARD), (1, 0, BACKWARD), (1, 2, FORWARD),
        (2, 0, FORWARD), (2, 1, BACKWARD)]
    # two pipelines of a DP=2 x PP=2 job with 2 chunks, in global ranks; no self-edges
    edges = pipeline_edges([[0, 2], [1, 3]], num_chunks=2)
    act, grad = MessageKind.ACTIVATION, MessageKind.GRADIENT
    assert edges == [Edge(0, 2, act), Edge(0, 2, grad), Edge(1, 3, act), Edge(1, 3, grad),
                     Edge(2, 0, act), Edge(2, 0, grad), Edge(3, 1, act), Edge(3, 1, grad)]
    assert pipeline_edges([[0]], num_chunks=2) == []


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="pp_size 0"):
        PipelineTopology(0)
    with pytest.raises(ValueError, match="rank 2, chunk 0 not in PipelineTopology"):
        PipelineTopology(2).virtual_stage(2, 0)
    with pytest.raises(ValueError, match="virtual stage 4 not in"):
        PipelineTopology(2, 2).placement(4)


def test_no_other_module_computes_virtual_stages():
    """The virtual-stage arithmetic lives in topology.py and nowhere else."""
    pattern = re.compile(r"chunk \* .*pp|// .*pp_size")
    root = REPO / "megatron" / "dpp"
    hits = {path.name for path in root.rglob("*.py")
            if any(pattern.search(line) for line in path.read_text().splitlines())}
    assert hits == {"topology.py"}
