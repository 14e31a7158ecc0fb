"""The pipeline simulator: closed forms, DPP == static under uniform costs, DPP gains."""

import json

import pytest

from megatron.dpp.actions import BACKWARD, WEIGHT, Task
from megatron.dpp.plan import StageConfig, static_order
from megatron.dpp.policy import microbatch_order_for
from megatron.dpp.sim.bounds import memory_free_bound
from megatron.dpp.sim.simulate import main
from megatron.dpp.sim.simulator import CostModel, compare, sample_durations, simulate
from megatron.dpp.variability import StragglerProfile


def uniform(p, m, chunks=1):
    return sample_durations(CostModel(), p, chunks, m, seed=0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (8, 32)])
def test_1f1b_and_gpipe_closed_forms(p, m):
    tf, tb = 1.0, 2.0
    one_f_one_b = simulate("1f1b", p, m, uniform(p, m))
    assert one_f_one_b.makespan == pytest.approx((m + p - 1) * (tf + tb))
    assert one_f_one_b.peak_in_flight == [min(p - r, m) for r in range(p)]
    gpipe = simulate("gpipe", p, m, uniform(p, m))
    assert gpipe.makespan == pytest.approx((m + p - 1) * (tf + tb))
    assert gpipe.peak_in_flight == [m] * p
    expected_bubble = (p - 1) / (m + p - 1)
    assert one_f_one_b.bubble == pytest.approx([expected_bubble] * p)


def test_latency_adds_per_hop():
    p, m, latency = 4, 8, 0.25
    result = simulate("1f1b", p, m, uniform(p, m), latency=latency)
    # the last microbatch's forward and backward each cross p - 1 links after the steady
    # state, and the first one crosses them before it
    assert result.makespan > (m + p - 1) * 3.0
    assert result.makespan <= (m + p - 1) * 3.0 + 2 * (p - 1) * latency * m


@pytest.mark.parametrize("p,m,chunks", [(2, 8, 1), (4, 16, 1), (4, 5, 1), (4, 8, 2), (2, 4, 2)])
def test_uniform_dpp_reproduces_static_order(p, m, chunks):
    base = "1f1b" if chunks == 1 else "interleaved"
    static = simulate(base, p, m, uniform(p, m, chunks), num_chunks=chunks)
    dpp = simulate("dpp", p, m, uniform(p, m, chunks), num_chunks=chunks, record=True)
    assert dpp.makespan == static.makespan
    for r in range(p):
        assert dpp.orders[r] == static_order(StageConfig(r, p, chunks, m))


def test_uniform_interleaved_beats_1f1b():
    p, m = 4, 8
    results = compare(p, m, CostModel(), num_chunks=2)
    assert results["interleaved"].makespan < results["1f1b"].makespan


@pytest.mark.parametrize("model", [CostModel(cv=0.5), CostModel(jitter=0.3)])
def test_dpp_under_variance(model):
    p, m = 4, 16
    durations = sample_durations(model, p, 1, m, seed=3)
    static = simulate("1f1b", p, m, durations)
    equal_memory = simulate("dpp", p, m, durations, slack=0)
    with_slack = simulate("dpp", p, m, durations, slack=2)
    assert equal_memory.makespan <= static.makespan
    assert max(equal_memory.peak_in_flight) <= max(static.peak_in_flight)
    assert with_slack.makespan < static.makespan
    assert max(with_slack.peak_in_flight) <= max(static.peak_in_flight) + 2


def test_same_factor_on_every_stage():
    durations = sample_durations(CostModel(cv=0.5), 3, 1, 6, seed=1)
    assert durations.forward[0] == durations.forward[2]
    assert durations.backward[1] == [2 * x for x in durations.forward[1]]
    slow = sample_durations(CostModel(slow_stage=1, slow_factor=1.5), 3, 1, 2, seed=0)
    assert slow.forward[1] == [1.5, 1.5] and slow.forward[0] == [1.0, 1.0]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="slow_stage 5"):
        sample_durations(CostModel(slow_stage=5), 4, 1, 4, seed=0)
    with pytest.raises(ValueError, match="cv"):
        CostModel(cv=-1)
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate("zb", 2, 2, uniform(2, 2))


def test_cli_json_and_trace(tmp_path, capsys):
    """The CLI reports the simulator's own makespans and ratios (1F1B's makespan over each
    other schedule's), and writes the DPP run's trace task by task."""
    trace = tmp_path / "trace.json"
    main(["--pp", "2", "--microbatches", "4", "--cv", "0.5", "--slack", "2", "--json",
          "--trace", str(trace)])
    report = json.loads(capsys.readouterr().out)["schedules"]
    assert set(report) == {"1f1b", "gpipe", "dpp", "dpp-static"}
    expected = compare(2, 4, CostModel(cv=0.5), slack=2, record=True)
    for name, result in expected.items():
        assert report[name]["makespan"] == result.makespan
        assert report[name]["peak_in_flight_per_stage"] == result.peak_in_flight
    assert "speedup_vs_1f1b" not in report["1f1b"]
    for name in ("gpipe", "dpp"):
        ratio = expected["1f1b"].makespan / expected[name].makespan
        assert report[name]["speedup_vs_1f1b"] == ratio
    assert report["dpp"]["speedup_vs_1f1b"] > 1.0  # cv 0.5 with known costs and slack
    events = json.loads(trace.read_text())["traceEvents"]
    assert len(events) == 2 * 2 * 4
    for rank in (0, 1):
        ran = [(e["args"]["kind"], e["args"]["chunk"], e["args"]["microbatch"])
               for e in sorted(events, key=lambda e: e["ts"]) if e["tid"] == rank]
        assert ran == [tuple(task) for task in expected["dpp"].orders[rank]]


def test_cli_iterations_report_the_mean_of_each_iterations_draws(capsys):
    """--iterations N: each schedule's makespan is the mean over iterations i..i+N-1 of
    the straggler draws, each iteration's what --iteration alone gives."""
    flags = ["--pp", "4", "--microbatches", "8", "--slack", "2", "--forward-ms", "8",
             "--emulate-straggler", "all:0.3:3", "--schedules", "1f1b", "dpp", "--json"]
    single = []
    for iteration in (1, 2, 3):
        main([*flags, "--iteration", str(iteration)])
        single.append(json.loads(capsys.readouterr().out)["schedules"])
    main([*flags, "--iteration", "1", "--iterations", "3"])
    report = json.loads(capsys.readouterr().out)["schedules"]
    mean = {name: sum(run[name]["makespan"] for run in single) / 3 for name in ("1f1b", "dpp")}
    assert len({run["1f1b"]["makespan"] for run in single}) > 1  # the draws differ
    for name in ("1f1b", "dpp"):
        assert report[name]["makespan"] == pytest.approx(mean[name])
    assert report["dpp"]["speedup_vs_1f1b"] == pytest.approx(mean["1f1b"] / mean["dpp"])


def test_cli_lower_bound_is_the_mean_bound_of_each_iterations_tasks(capsys):
    """The report's lower bound: the memory-free bound of each iteration's sampled tasks,
    averaged as the makespans are, below every schedule's; the text names each schedule's
    makespan over it."""
    flags = ["--pp", "4", "--microbatches", "8", "--slack", "2", "--forward-ms", "8",
             "--split-backward", "--slow-stage", "3", "--slow-factor", "1.5",
             "--emulate-straggler", "all:0.3:3", "--schedules", "1f1b", "dpp",
             "--iteration", "1", "--iterations", "3"]
    main([*flags, "--json"])
    report = json.loads(capsys.readouterr().out)
    cost = CostModel(forward=8.0, slow_stage=3, slow_factor=1.5,
                     straggler=StragglerProfile.parse("all:0.3:3"))
    bounds = [memory_free_bound(sample_durations(cost, 4, 1, 8, 0, True, i).by_kind(True), 4, 8)
              for i in (1, 2, 3)]
    assert report["lower_bound"] == pytest.approx(sum(bounds) / 3)
    assert len(set(bounds)) > 1  # each iteration's own draws
    for entry in report["schedules"].values():
        assert entry["makespan"] > report["lower_bound"]
        # in the microbatch order at the memory the schedule held: tighter, still below;
        # with the W tasks in that order too (as both ran them) tighter again
        assert report["lower_bound"] <= entry["in_order_bound"] <= entry["makespan"]
        assert entry["in_order_bound"] <= entry["weights_in_order_bound"] <= entry["makespan"]
    main(flags)
    memory_free, in_order, weights_in_order = capsys.readouterr().out.splitlines()[-3:]
    dpp = report["schedules"]["dpp"]
    ratio = dpp["makespan"] / report["lower_bound"]
    assert memory_free.startswith(f"no schedule of these tasks, at any memory, takes less than "
                                  f"{report['lower_bound']:.2f}")
    assert memory_free.endswith(f"dpp {ratio:.3f}x")
    assert in_order.endswith(f"dpp {dpp['in_order_bound']:.2f} (it took "
                             f"{dpp['makespan'] / dpp['in_order_bound']:.3f}x)")
    assert weights_in_order.startswith("no such schedule that runs each stage's W tasks in "
                                       "that order too")
    assert weights_in_order.endswith(
        f"dpp {dpp['weights_in_order_bound']:.2f} (it took "
        f"{dpp['makespan'] / dpp['weights_in_order_bound']:.3f}x)")


def test_cli_grid_small(capsys):
    main(["--grid", "--grid-pp", "2", "--seeds", "2", "--jobs", "1"])
    out = capsys.readouterr().out
    assert out.count("| 2 | 8 |") == 8  # 4 cost models x 2 slacks


def test_grid_seed_offset_and_extra_model(capsys):
    """--seed-offset runs other seeds (held out from the grid's); --grid-models picks the
    cost models, including cv 0.5 with per-task jitter on top (not in the default grid)."""
    def rows(*extra):
        main(["--grid", "--grid-pp", "2", "--seeds", "3", "--jobs", "1", "--json", *extra])
        return json.loads(capsys.readouterr().out)["rows"]

    base, shifted = rows(), rows("--seed-offset", "3")
    cv = [[r["ratio_mean"] for r in run if r["model"] == "cv 0.5"] for run in (base, shifted)]
    assert cv[0] != cv[1]
    uniform = [[r["ratio_mean"] for r in run if r["model"] == "uniform"] for run in (base, shifted)]
    assert uniform[0] == uniform[1] == [1.0, 1.0]
    extra = rows("--grid-models", "cv 0.5 + jitter 0.3", "--grid-slacks", "2")
    assert [(r["model"], r["slack"], r["seeds"]) for r in extra] == [("cv 0.5 + jitter 0.3", 2, 3)]
    with pytest.raises(SystemExit):
        main(["--grid", "--seed-offset", "-1"])


def test_slack_gain_and_memory_on_the_grid_cells():
    """+2 slack, p = 4, m = 16, cv 0.5 over 10 seeds: the rule of docs/benchmarks/
    simulator.md (mean 1.206x of 1F1B; 1.172x when every rank's plan took the whole slack
    as extra warmup). The last stage holds one microbatch, like 1F1B."""
    p, m = 4, 16
    ratios = []
    for seed in range(10):
        durations = sample_durations(CostModel(cv=0.5), p, 1, m, seed)
        static = simulate("1f1b", p, m, durations)
        dpp = simulate("dpp", p, m, durations, slack=2)
        assert dpp.peak_in_flight[p - 1] == 1
        assert all(dpp.peak_in_flight[r] <= p - r + 2 for r in range(p))
        ratios.append(static.makespan / dpp.makespan)
    assert sum(ratios) / len(ratios) > 1.19


def test_known_costs_order_the_microbatches_within_the_same_memory():
    """cv 0.5, p = 4, m = 16, 10 seeds: with the per-microbatch costs known before the
    iteration (token counts), DPP runs cheap microbatches first and last; docs/benchmarks/
    simulator.md: 1.403x of 1F1B at +2 slack (1.206x without the costs; 1.392x with the
    previous, symmetric cost order), and 1F1B's microbatch count in flight at +0."""
    p, m = 4, 16
    known, unknown = [], []
    for seed in range(10):
        durations = sample_durations(CostModel(cv=0.5), p, 1, m, seed)
        static = simulate("1f1b", p, m, durations)
        costs = durations.microbatch_factor
        ordered = simulate("dpp", p, m, durations, slack=2, microbatch_costs=costs)
        equal_memory = simulate("dpp", p, m, durations, slack=0, microbatch_costs=costs)
        assert equal_memory.makespan <= static.makespan
        assert max(equal_memory.peak_in_flight) <= max(static.peak_in_flight)
        assert all(ordered.peak_in_flight[r] <= p - r + 2 for r in range(p))
        known.append(static.makespan / ordered.makespan)
        unknown.append(static.makespan / simulate("dpp", p, m, durations, slack=2).makespan)
    assert sum(known) / 10 > 1.40 > 1.21 > sum(unknown) / 10


def test_split_durations_halve_the_backward():
    """With the split, B and W take the backward's time in equal shares (F = B = W), each
    with its own jitter; schedules without the split see their sum."""
    uniform_split = sample_durations(CostModel(), 2, 1, 3, seed=0, split_backward=True)
    assert uniform_split.backward == uniform_split.weight == uniform_split.forward
    whole = uniform_split.by_kind()
    assert whole[BACKWARD] == [[2.0] * 3] * 2 and WEIGHT not in whole
    jittered = sample_durations(CostModel(jitter=0.3), 2, 1, 3, seed=0, split_backward=True)
    assert jittered.backward[0] != jittered.weight[0]
    with pytest.raises(ValueError, match="split_backward=True"):
        uniform(2, 3).by_kind(split_backward=True)
    with pytest.raises(ValueError, match="weight_share"):
        CostModel(weight_share=1.0)


@pytest.mark.parametrize("p", [2, 4, 8, 16, 32, 64])
def test_uniform_split_dpp_runs_zb_h1(p):
    """Target 1 of docs/benchmarks/simulator_split.md: uniform F = B = W, m = 4p, slack
    0: DPP with W tasks runs ZB-H1's orders exactly, makespan 3m + p - 1; every rank holds
    its 1F1B count from F to B and at most rank 0's (p) from F to W; >= 1.10x 1F1B at
    p = 4 and >= 1.12x at p = 8 (1.118x, 1.136x). All with the W deferred as ZB-H1
    defers them (`defer_weights`)."""
    m = 4 * p
    durations = sample_durations(CostModel(), p, 1, m, seed=0, split_backward=True)
    dpp = simulate("dpp", p, m, durations, split_backward=True, record=True,
                   defer_weights=True)
    zb_h1 = simulate("zb-h1", p, m, durations)
    one_f_one_b = simulate("1f1b", p, m, durations)
    for r in range(p):
        assert dpp.orders[r] == static_order(StageConfig(r, p, 1, m, split_backward=True))
    assert dpp.makespan == zb_h1.makespan == 3 * m + p - 1
    assert dpp.peak_activations == one_f_one_b.peak_in_flight == [p - r for r in range(p)]
    assert dpp.peak_in_flight == [p] * p
    speedup = one_f_one_b.makespan / dpp.makespan
    assert speedup >= {2: 1.08, 4: 1.10, 8: 1.12}.get(p, 1.12)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_uniform_split_dpp_without_deferral_holds_1f1b_memory(p):
    """The default placement (each W right after its B): uniform F = B = W, m = 4p, slack
    0: DPP runs that plan exactly, every rank holds its own 1F1B count (p - r) from F to W
    as from F to B, and the makespan is 3m + 2 (p - 1): between ZB-H1's 3m + p - 1 and
    1F1B's 3 (m + p - 1)."""
    m = 4 * p
    durations = sample_durations(CostModel(), p, 1, m, seed=0, split_backward=True)
    dpp = simulate("dpp", p, m, durations, split_backward=True, record=True,
                   defer_weights=False)
    for r in range(p):
        stage = StageConfig(r, p, 1, m, split_backward=True, defer_weights=False)
        plan = static_order(stage)
        assert dpp.orders[r] == plan
        weights = [k for k, task in enumerate(plan) if task.kind == WEIGHT]
        assert all(plan[k - 1] == Task(BACKWARD, 0, plan[k].microbatch) for k in weights)
    assert dpp.peak_in_flight == dpp.peak_activations == [p - r for r in range(p)]
    assert dpp.makespan == 3 * m + 2 * (p - 1)
    assert simulate("1f1b", p, m, durations).makespan == 3 * (m + p - 1)


@pytest.mark.parametrize(("model", "p", "gain_at_0", "gain_at_2"), [
    (CostModel(jitter=0.3), 4, 1.03, 1.05), (CostModel(jitter=0.3), 8, 1.04, 1.07),
    (CostModel(cv=0.5), 4, 1.01, 1.03), (CostModel(slow_stage=2, slow_factor=1.3), 4, 1.0, 1.01)])
def test_split_dpp_under_variance_against_ordered_baselines(model, p, gain_at_0, gain_at_2):
    """Five seeds of grid cells: 1F1B and ZB-H1 fed DPP's microbatch order. DPP is never
    slower than 1F1B; it beats ZB-H1 by the grid's margins (W in 4 parts; 10 seeds, +0 /
    +2: jitter p = 4 1.037x / 1.061x, p = 8 1.055x / 1.083x, cv p = 4 1.020x / 1.035x); at
    +0 it holds ZB-H1's memory (the W deferred as ZB-H1 defers them). The slow stage at +0 runs ZB-H1's schedule (equal up to
    the rounding of W's time summed in parts)."""
    m = 4 * p
    at_zero, at_two = [], []
    for seed in range(5):
        durations = sample_durations(model, p, 1, m, seed, split_backward=True)
        for slack, ratios in ((0, at_zero), (2, at_two)):
            stage = StageConfig(0, p, 1, m, slack=slack, split_backward=True)
            order = microbatch_order_for(stage, durations.microbatch_factor)
            dpp = simulate("dpp", p, m, durations, slack=slack, microbatch_order=order,
                           split_backward=True, defer_weights=True)
            baselines = {name: simulate(name, p, m, durations, microbatch_order=order)
                         for name in ("1f1b", "zb-h1")}
            assert dpp.makespan < baselines["1f1b"].makespan
            assert max(dpp.peak_in_flight) <= p + slack
            assert all(dpp.peak_activations[r] <= p - r + slack for r in range(p))
            ratios.append(baselines["zb-h1"].makespan / dpp.makespan)
    assert sum(at_zero) / 5 > gain_at_0 - 1e-9
    assert sum(at_two) / 5 > gain_at_2


def test_cli_split_backward_report_and_grid(capsys):
    main(["--pp", "4", "--microbatches", "16", "--split-backward", "--slack", "0", "--cv", "0.5",
          "--json"])
    report = json.loads(capsys.readouterr().out)["schedules"]
    assert set(report) == {"1f1b", "gpipe", "zb-h1", "dpp", "dpp-static"}
    assert report["zb-h1"]["peak_activations_per_stage"] == [4, 3, 2, 1]
    assert report["zb-h1"]["peak_in_flight_per_stage"] == [4, 4, 4, 4]
    # the static schedules ran DPP's microbatch order
    durations = sample_durations(CostModel(cv=0.5), 4, 1, 16, 0, split_backward=True)
    order = microbatch_order_for(StageConfig(0, 4, 1, 16, split_backward=True),
                                 durations.microbatch_factor)
    assert order != sorted(order)
    for name in ("1f1b", "zb-h1"):
        expected = simulate(name, 4, 16, durations, microbatch_order=order)
        assert report[name]["makespan"] == expected.makespan
    main(["--pp", "4", "--microbatches", "16", "--split-backward", "--slack", "0",
          "--defer-weights"])
    lines = capsys.readouterr().out.splitlines()
    assert "speedup: 1f1b 1.118x, zb-h1 1.000x" in lines[-6]
    assert lines[-4].endswith("peak in flight per stage: 4 4 4 4 (F to W; F to B: 4 3 2 1)")
    # the default: each W after its B, 1F1B's memory on every stage (57 / 54, 51 / 54)
    main(["--pp", "4", "--microbatches", "16", "--split-backward", "--slack", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert "speedup: 1f1b 1.056x, zb-h1 0.944x" in lines[-6]
    assert lines[-4].endswith("peak in flight per stage: 4 3 2 1")
    main(["--grid", "--split-backward", "--defer-weights", "--grid-pp", "2", "--seeds", "2",
          "--jobs", "1"])
    out = capsys.readouterr().out
    assert out.count("| 2 | 8 |") == 8
    assert "| 2 | 8 | uniform | +0 | 1.080x | 1.080x | 1.000x | 1.000x |" in out


def _two_by_two(stretch_rank0_forward1: float = 0.0):
    """p = 2, m = 2, every F and B of unit time; rank 0's forward of microbatch 1 stretched by
    a wait."""
    durations = sample_durations(CostModel(backward_ratio=1.0), 2, 1, 2, seed=0)
    zero = [[0.0, 0.0], [0.0, 0.0]]
    durations.forward[0][1] += stretch_rank0_forward1
    durations.stretch = {"F": [[0.0, stretch_rank0_forward1], [0.0, 0.0]], "B": zero}
    return durations


def test_one_shared_core_runs_all_the_work_back_to_back():
    p, m = 4, 8
    durations = sample_durations(CostModel(jitter=0.3), p, 1, m, seed=3, split_backward=True)
    total = sum(sum(row) for table in durations.by_kind(True).values() for row in table)
    for schedule in ("1f1b", "dpp"):
        dedicated = simulate(schedule, p, m, durations, split_backward=True)
        one_core = simulate(schedule, p, m, durations, split_backward=True, cores=1)
        # nothing ever waits for a message, so the one core never idles
        assert one_core.makespan == pytest.approx(total)
        assert dedicated.makespan < total
        assert simulate(schedule, p, m, durations, split_backward=True,
                        cores=p).makespan == dedicated.makespan


def test_two_ranks_on_one_core_run_at_half_speed_and_a_wait_takes_no_core():
    # 1F1B: rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1
    assert simulate("1f1b", 2, 2, _two_by_two(), cores=1).makespan == pytest.approx(8.0)
    # rank 0's F1 computes beside rank 1's F0 (both at half speed, 1..3), then sleeps
    # 3..6 while rank 1 runs B0 alone (3..4); then rank 0's B0 beside rank 1's F1 (6..8),
    # rank 1's B1 (8..9), rank 0's B1 (9..10)
    shared = simulate("1f1b", 2, 2, _two_by_two(3.0), cores=1, record=True)
    assert shared.makespan == pytest.approx(10.0)
    spans = {(event["tid"], event["name"]): (event["ts"] / 1000, event["dur"] / 1000)
             for event in shared.trace}
    assert spans[0, "F1c0"] == pytest.approx((1.0, 5.0))
    assert spans[1, "B0c0"] == pytest.approx((3.0, 1.0))
    # with a processor each, the same wait is a longer task: 8
    assert simulate("1f1b", 2, 2, _two_by_two(3.0)).makespan == pytest.approx(8.0)


def test_stragglers_stretch_is_what_they_add():
    straggler = StragglerProfile.parse("all:0.3:3")
    plain = sample_durations(CostModel(forward=5.0), 4, 1, 8, seed=2, split_backward=True)
    stretched = sample_durations(CostModel(forward=5.0, straggler=straggler), 4, 1, 8,
                                 seed=2, split_backward=True)
    added = stretched.stretch_by_kind(True)
    for kind, table in stretched.by_kind(True).items():
        for v, row in enumerate(table):
            for i, value in enumerate(row):
                base = plain.by_kind(True)[kind][v][i]
                assert value - base == pytest.approx(added[kind][v][i])
                assert added[kind][v][i] in (0.0, pytest.approx(2 * base))
    whole = stretched.stretch_by_kind(False)
    assert whole["B"][1][3] == pytest.approx(added["B"][1][3] + added["W"][1][3])
    assert any(value > 0 for row in added["F"] for value in row)


def test_cli_cores_bound_is_the_compute_over_the_cores(capsys):
    main(["--pp", "4", "--microbatches", "8", "--forward-ms", "5", "--emulate-straggler",
          "all:0.2:3", "--cores", "2", "--schedules", "1f1b", "dpp", "--json"])
    report = json.loads(capsys.readouterr().out)
    durations = sample_durations(CostModel(forward=5.0, straggler=StragglerProfile.parse(
        "all:0.2:3")), 4, 1, 8, seed=0)
    compute = sum(sum(row) for table in durations.by_kind().values() for row in table) - sum(
        sum(row) for table in durations.stretch_by_kind().values() for row in table)
    assert report["lower_bound"] == pytest.approx(compute / 2)
    for entry in report["schedules"].values():
        assert entry["makespan"] >= compute / 2
    with pytest.raises(SystemExit):
        main(["--cores", "0"])
