"""Research tools on the pure schedule code: the discrete-event simulator of pipeline
schedules and replays of recorded orders (simulator.py), its command line (simulate.py) and
comparison grid (simulate_grid.py), DPP against static schedules fed the same order
(baselines.py) and lower bounds on any schedule's makespan (bounds.py).

Imports megatron.dpp's algorithm (actions, config, engine, plan, policy, topology); the
runtime never imports this package (tests/design/test_design_layers.py checks it)."""
