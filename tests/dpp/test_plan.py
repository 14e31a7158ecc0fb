"""Plans as data: megatron-core 0.16.1's own 1F1B and interleaved orders (goldens recorded
by tests/golden/record_megatron_plans.py), the checker's verdicts, the CSV form and the
`python -m megatron.dpp.plan` command line."""

import csv
import io

import pytest

from megatron.dpp.actions import (
    ActionFileError,
    Task,
    format_actions,
    in_flight_profile,
    parse_actions,
    read_actions,
)
from megatron.dpp.plan import (
    PlanError,
    StageConfig,
    build_plans,
    check_plans,
    main,
    plan_order,
    plan_skeleton,
    split_skeleton,
    static_order,
)
from megatron.dpp.policy import GreedyPolicy, plan_extra_warmup
from megatron.dpp.topology import PipelineTopology
from tests import TESTS

GOLDEN = TESTS / "golden" / "megatron_core_0.16.1"


def golden_cases():
    for p in (2, 4, 8):
        for chunks in (1, 2):
            for m in (p, 2 * p + 1, 4 * p):
                yield ("interleaved" if chunks > 1 else "1f1b"), p, chunks, m


def test_plans_equal_what_megatron_core_executes():
    """Every (P, C, M) of the grid is either a golden megatron-core ran, which the plan
    generator reproduces rank by rank, or one megatron-core refused, which the generator
    refuses too."""
    with open(GOLDEN / "rejected.csv", newline="") as file:
        rejected = {(row["schedule"], int(row["pp"]), int(row["chunks"]),
                     int(row["microbatches"])) for row in csv.DictReader(file)}
    for case in golden_cases():
        schedule, p, chunks, m = case
        path = GOLDEN / f"{schedule}_p{p}_c{chunks}_m{m}.csv"
        if case in rejected:
            assert not path.exists()
            with pytest.raises(ValueError, match="megatron-core rejects this too"):
                build_plans(schedule, p, m, chunks)
            continue
        golden = read_actions(str(path))[None]
        assert sorted(golden) == list(range(p)), path
        plans = build_plans(schedule, p, m, chunks)
        for rank in range(p):
            assert plans[rank] == golden[rank], f"{path.name}: rank {rank}"
        check_plans(plans, PipelineTopology(p, chunks), m)


@pytest.mark.parametrize("p,chunks,m", [(2, 1, 5), (4, 1, 16), (4, 2, 8), (3, 3, 6),
                                        (8, 1, 32), (4, 2, 12)])
@pytest.mark.parametrize("slack", [0, 1, 2, 5])
def test_dpp_plans_are_complete_and_deadlock_free(p, chunks, m, slack):
    """The policy's plan (megatron's with extra warmup forwards) on every rank at once,
    and within the policy's in-flight cap."""
    stages = [StageConfig(r, p, chunks, m, slack=slack) for r in range(p)]
    plans = [plan_order(s, plan_extra_warmup(s)) for s in stages]
    check = check_plans(plans, PipelineTopology(p, chunks), m)
    for stage, peak in zip(stages, check.peak_in_flight, strict=True):
        assert peak <= GreedyPolicy(stage).cap


def test_the_checker_names_the_rank_and_action():
    topology = PipelineTopology(2)
    good = build_plans("1f1b", 2, 3)
    assert check_plans(good, topology, 3).peak_in_flight == [2, 1]
    missing = [good[0], good[1][:-1]]
    with pytest.raises(PlanError, match=r"rank 1: B\(chunk 0, microbatch 2\) is missing"):
        check_plans(missing, topology, 3)
    twice = [good[0] + [Task("F", 0, 1)], good[1]]
    with pytest.raises(PlanError, match=r"rank 0: F\(chunk 0, microbatch 1\) appears twice "
                                        r"\(actions 1 and 6\)"):
        check_plans(twice, topology, 3)
    foreign = [good[0], good[1] + [Task("F", 1, 0)]]
    with pytest.raises(PlanError, match=r"rank 1, action 6: F\(chunk 1, microbatch 0\) is not "
                                        "a task of this pipeline"):
        check_plans(foreign, topology, 3)
    # the last rank runs B1 (its loss is local) before F1
    early = list(good[1])
    early.insert(2, early.pop(early.index(Task("B", 0, 1))))
    with pytest.raises(PlanError, match=r"rank 1, action 2: B\(chunk 0, microbatch 1\) can "
                                        r"never run: it needs F\(chunk 0, microbatch 1\) of "
                                        "the same rank, which comes later in its plan"):
        check_plans([good[0], early], topology, 3)
    # rank 0 runs every backward before its forwards' outputs reach rank 1
    backwards_first = [[t for t in good[0] if t.kind == "B"] + [t for t in good[0]
                                                               if t.kind == "F"], good[1]]
    with pytest.raises(PlanError, match=r"rank 0, action 0: B\(chunk 0, microbatch 0\) can "
                                        r"never run: it needs F\(chunk 0, microbatch 0\) of "
                                        "the same rank"):
        check_plans(backwards_first, topology, 3)
    # a cross-rank deadlock: rank 1 wants microbatch 1 first, rank 0 sends 0 first and
    # waits for its gradient
    one_by_one = [Task(kind, 0, i) for i in (0, 1, 2) for kind in "FB"]
    crossed = [one_by_one, one_by_one[2:4] + one_by_one[:2] + one_by_one[4:]]
    with pytest.raises(PlanError, match=r"rank 0, action 1: B\(chunk 0, microbatch 0\) can "
                                        r"never run: it needs the output of B\(chunk 0, "
                                        r"microbatch 0\) on rank 1, which never runs \(rank 1 "
                                        r"is stuck at action 0: F\(chunk 0, microbatch 1\)\)"):
        check_plans(crossed, topology, 3)


def test_split_backward_plans_are_checked_too():
    """W (weight gradient) tasks: each needs its own B, frees the microbatch's activations,
    and is missing nowhere once any rank's plan has one."""
    def plan(*names):
        return [Task(name[0], 0, int(name[1])) for name in names]

    plans = [plan("F0", "F1", "B0", "W0", "B1", "W1"), plan("F0", "B0", "F1", "W0", "B1", "W1")]
    check = check_plans(plans, PipelineTopology(2), 2)
    assert check.peak_in_flight == [2, 2]  # rank 1 holds microbatch 0 until W0
    assert in_flight_profile(plans[1]) == [0, 1, 1, 2, 1, 1, 0]
    with pytest.raises(PlanError, match=r"rank 1: W\(chunk 0, microbatch 1\) is missing"):
        check_plans([plans[0], plans[1][:-1]], PipelineTopology(2), 2)
    early = [plans[0], plan("F0", "W0", "B0", "F1", "B1", "W1")]
    with pytest.raises(PlanError, match=r"rank 1, action 1: W\(chunk 0, microbatch 0\) can "
                                        r"never run: it needs B\(chunk 0, microbatch 0\)"):
        check_plans(early, PipelineTopology(2), 2)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 4), (4, 16), (4, 3), (8, 33)])
def test_zb_h1_holds_rank_0s_count_and_cuts_the_bubble_to_p_minus_1(p, m):
    """ZB-H1: every rank holds 1F1B's count of its own from F to B and, with the W tasks
    it defers, at most rank 0's from F to W; with F = B = W = 1 the makespan is
    3m + p - 1 (1F1B: 3 (m + p - 1)). W right after B would keep every rank's F-to-W count
    at 1F1B's, at a makespan of 3m + 2p - 2: the last rank's strict F, B, W alternation."""
    plans = build_plans("zb-h1", p, m)
    check = check_plans(plans, PipelineTopology(p), m)
    assert check.peak_activations == [min(p - r, m) for r in range(p)]
    assert check.peak_in_flight == [min(p, m)] * p
    if m >= p:
        assert check.makespan == 3 * m + p - 1
    for r, plan in enumerate(plans):
        # 1F1B's order of forwards and backwards, each W `delay` backwards after its B
        # (r, or fewer where m < p: rank 0's count minus this rank's)
        assert [t for t in plan if t.kind != "W"] == build_plans("1f1b", p, m)[r]
        backwards = [t.microbatch for t in plan if t.kind == "B"]
        assert [t.microbatch for t in plan if t.kind == "W"] == backwards
        delay = min(p, m) - min(p - r, m)
        assert plan.index(Task("W", 0, 0)) == plan.index(Task("B", 0, delay)) + 1
    right_after = [[Task(*entry) for entry in
                    split_skeleton(plan_skeleton(StageConfig(r, p, 1, m)), 0)] for r in range(p)]
    strict = check_plans(right_after, PipelineTopology(p), m)
    assert strict.peak_in_flight == [min(p - r, m) for r in range(p)]
    # what StageConfig.defer_weights=False plans
    assert right_after == [static_order(StageConfig(r, p, 1, m, split_backward=True,
                                                    defer_weights=False)) for r in range(p)]
    if m >= p:
        assert strict.makespan == 3 * m + 2 * p - 2


def test_split_interleaved_plans_defer_w_to_rank_0s_count():
    """With virtual chunks the split plan defers each W by twice the rank (rank 0's
    interleaved peak minus this rank's), so every rank holds rank 0's count from F to W."""
    p, chunks, m = 4, 2, 8
    plans = [static_order(StageConfig(r, p, chunks, m, split_backward=True)) for r in range(p)]
    check = check_plans(plans, PipelineTopology(p, chunks), m)
    unsplit = check_plans(build_plans("interleaved", p, m, chunks), PipelineTopology(p, chunks), m)
    assert check.peak_activations == unsplit.peak_in_flight == [11, 9, 7, 5]
    assert check.peak_in_flight == [11] * p
    assert check.makespan < unsplit.makespan


def test_actions_csv_round_trip_and_errors():
    plans = build_plans("interleaved", 2, 4, 2)
    text = format_actions(dict(enumerate(plans)))
    assert text.splitlines()[0] == "rank,kind,chunk,microbatch"
    assert parse_actions(io.StringIO(text)) == {None: dict(enumerate(plans))}
    with_iterations = "iteration,rank,kind,chunk,microbatch\n3,1,F,0,0\n4,1,B,0,0\n"
    assert parse_actions(io.StringIO(with_iterations)) == {
        3: {1: [Task("F", 0, 0)]}, 4: {1: [Task("B", 0, 0)]}}
    with pytest.raises(ActionFileError, match=r"x.csv:1: header \['rank', 'kind'\]"):
        parse_actions(io.StringIO("rank,kind\n"), "x.csv")
    with pytest.raises(ActionFileError, match=r"x.csv:3: bad action \['0', 'X', '0', '1'\]"):
        parse_actions(io.StringIO("rank,kind,chunk,microbatch\n0,F,0,0\n0,X,0,1\n"), "x.csv")
    with pytest.raises(ActionFileError, match="x.csv:2: expected 4 fields"):
        parse_actions(io.StringIO("rank,kind,chunk,microbatch\n0,F,zero,0\n"), "x.csv")


def test_cli_prints_the_checked_plan(capsys):
    assert main(["--schedule", "interleaved", "--pp", "2", "--microbatches", "4", "--csv"]) == 0
    printed = parse_actions(io.StringIO(capsys.readouterr().out))[None]
    assert printed == dict(enumerate(build_plans("interleaved", 2, 4, 2)))
    main(["--schedule", "1f1b", "--pp", "4", "--microbatches", "8", "--rank", "2", "--csv"])
    assert parse_actions(io.StringIO(capsys.readouterr().out))[None] == {
        2: build_plans("1f1b", 4, 8)[2]}
    main(["--schedule", "1f1b", "--pp", "2", "--microbatches", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["rank", "kind", "chunk", "microbatch"]
    assert [line.split() for line in lines[1:4]] == [["0", "F", "0", "0"], ["0", "F", "0", "1"],
                                                     ["0", "B", "0", "0"]]
    assert len(lines) == 1 + 12 + 1
    # 1F1B with F = 1, B = 2: (m + p - 1) (F + B)
    assert lines[-1].endswith("peak in flight per rank: 2 1; makespan 12 with F = 1, B = 2")
    main(["--schedule", "zb-h1", "--pp", "2", "--microbatches", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 18 + 1
    assert lines[-1].endswith("peak in flight per rank: 2 2 (F to W; F to B: 2 1); makespan 10 "
                              "with F = 1, B = W = 1")
    for argv, message in [
        (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--chunks", "2"],
         "1f1b has one chunk per rank"),
        (["--schedule", "zb-h1", "--pp", "2", "--microbatches", "4", "--chunks", "2"],
         "zb-h1 has one chunk per rank"),
        (["--schedule", "interleaved", "--pp", "4", "--microbatches", "6"],
         "megatron-core rejects this too"),
        (["--schedule", "gpipe", "--pp", "2", "--microbatches", "4", "--rank", "2"],
         "--rank 2 not in [0, 2)"),
    ]:
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
