"""PNG timeline of pipeline runs: one row per stage, forward and backward boxes labelled
with their microbatch (and chunk), receive-wait as a hatched strip below a row, send as a
dark strip above it, grad sync and optimizer step in grey, idle time blank.
Several runs stack on one time axis (e.g. 1F1B above DPP).

    python profiling/plot_timeline.py traces -o timeline.png
    python profiling/plot_timeline.py runs/1f1b runs/dpp --labels 1F1B DPP --iteration 3 \\
        -o 1f1b_vs_dpp.png

Each RUN is a --trace directory, profiling/aggregate.py's trace.json, or a simulator trace
(python -m megatron.dpp.sim.simulate --trace FILE). A stage with several ranks (tensor / data
parallel) is drawn from its lowest rank. Each run's time starts at its first task.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `profiling` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profiling.aggregate import Span, TraceError, load_spans, load_trace  # noqa: E402
from profiling.report import iteration_reports  # noqa: E402

COLORS = {"forward": ("#8fb8de", "#4a7fb5"), "backward": ("#f4b183", "#c55a11"),
          "weight": ("#a9d18e", "#548235")}
STEP_COLOR = "#b0b0b0"
WAIT_COLOR = "#d9534f"
SEND_COLOR = "#404040"
FIGURE_WIDTH = 14.0


def select(spans: list[Span], iteration: int | None) -> list[Span]:
    """The spans of one iteration (None: all) of each stage's lowest rank."""
    lowest: dict[int, int] = {}
    for span in spans:
        lowest[span.stage] = min(span.rank, lowest.get(span.stage, span.rank))
    return [s for s in spans if s.rank == lowest[s.stage]
            and (iteration is None or s.iteration == iteration)]


def _label(span: Span, chunked: bool) -> str:
    if span.microbatch is None:
        return {"grad_sync": "sync", "optimizer": "opt"}.get(span.kind, "")
    return f"{span.microbatch}" + (f"c{span.chunk}" if chunked else "")


def _draw_run(ax, spans: list[Span], origin: float, scale_pt_per_ms: float, title: str):
    from matplotlib.patches import Rectangle

    stages = sorted({s.stage for s in spans})
    chunked = any((s.chunk or 0) > 0 for s in spans)
    for row, stage in enumerate(stages):
        y = len(stages) - 1 - row
        for span in (s for s in spans if s.stage == stage):
            x = span.start - origin
            if span.kind in COLORS:
                color = COLORS[span.kind][1 if (span.chunk or 0) % 2 else 0]
                ax.add_patch(Rectangle((x, y + 0.1), span.duration, 0.8, facecolor=color,
                                       edgecolor="black", linewidth=0.4))
            elif span.kind == "recv_wait":
                ax.add_patch(Rectangle((x, y + 0.02), span.duration, 0.12, facecolor="none",
                                       edgecolor=WAIT_COLOR, hatch="////", linewidth=0.3))
                continue
            elif span.kind == "send":
                ax.add_patch(Rectangle((x, y + 0.9), span.duration, 0.07, facecolor=SEND_COLOR,
                                       linewidth=0))
                continue
            elif span.kind in ("grad_sync", "optimizer"):
                ax.add_patch(Rectangle((x, y + 0.1), span.duration, 0.8,
                                       facecolor=STEP_COLOR, edgecolor="black", linewidth=0.4))
            else:
                continue
            text = _label(span, chunked)
            if text and span.duration * scale_pt_per_ms > 6.5 * len(text) + 2:
                ax.text(x + span.duration / 2, y + 0.5, text, ha="center", va="center",
                        fontsize=8)
    ax.set_yticks([len(stages) - 1 - row + 0.5 for row in range(len(stages))])
    ax.set_yticklabels([f"stage {s}" for s in stages])
    ax.set_ylim(0, len(stages))
    ax.set_title(title, fontsize=10, loc="left")
    for y in range(1, len(stages)):
        ax.axhline(y, color="#dddddd", linewidth=0.5)


def _title(label: str, spans: list[Span], iterations: dict) -> str:
    reports = iteration_reports(spans, iterations)
    if not reports:
        return label
    makespan = sum(r["makespan_ms"] for r in reports) / len(reports)
    bubble = sum(r["mean_bubble"] for r in reports) / len(reports)
    per = " per iteration" if len(reports) > 1 else ""
    return f"{label}: makespan {makespan:.2f} ms{per}, mean bubble {bubble:.1%}"


def plot(runs: list[str], labels: list[str], output: str, iteration: int | None = None,
         title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    loaded = []
    for path, label in zip(runs, labels, strict=True):
        spans, iterations = load_spans(load_trace(path))
        chosen = select(spans, iteration)
        if not any(s.kind in COLORS for s in chosen):
            which = "" if iteration is None else f" in iteration {iteration}"
            raise TraceError(f"{path}: no forward/backward spans{which}")
        origin = min(s.start for s in chosen if s.kind in COLORS)
        end = max(s.end for s in chosen) - origin
        loaded.append((label, chosen, origin, end, iterations))
    width_ms = max(end for _, _, _, end, _ in loaded)
    heights = [max(1, len({s.stage for s in chosen})) for _, chosen, _, _, _ in loaded]
    figure, axes = plt.subplots(
        len(loaded), 1, sharex=True, squeeze=False,
        figsize=(FIGURE_WIDTH, 0.6 * sum(heights) + 1.2 * len(loaded) + 0.6),
        gridspec_kw={"height_ratios": heights},
    )
    scale = (FIGURE_WIDTH - 1.5) * 72.0 / width_ms  # points per ms, for label fitting
    for ax, (label, chosen, origin, _, iterations) in zip(axes[:, 0], loaded, strict=True):
        _draw_run(ax, chosen, origin, scale, _title(label, chosen, iterations))
    axes[-1, 0].set_xlim(0, width_ms * 1.01)
    axes[-1, 0].set_xlabel("time (ms)")
    legend = [Patch(facecolor=COLORS["forward"][0], edgecolor="black", label="forward"),
              Patch(facecolor=COLORS["backward"][0], edgecolor="black", label="backward"),
              *([Patch(facecolor=COLORS["weight"][0], edgecolor="black", label="weight (W)")]
                if any(s.kind == "weight" for _, chosen, _, _, _ in loaded for s in chosen)
                else []),
              Patch(facecolor="none", edgecolor=WAIT_COLOR, hatch="////",
                    label="receive-wait"),
              Patch(facecolor=SEND_COLOR, label="send"),
              Patch(facecolor=STEP_COLOR, edgecolor="black", label="grad sync / optimizer")]
    if any((s.chunk or 0) > 0 for _, chosen, _, _, _ in loaded for s in chosen):
        legend[2:2] = [Patch(facecolor=COLORS["forward"][1], edgecolor="black",
                             label="forward, odd chunk"),
                       Patch(facecolor=COLORS["backward"][1], edgecolor="black",
                             label="backward, odd chunk")]
    figure.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8,
                  frameon=False)
    if title:
        figure.suptitle(title)
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(output, dpi=120)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="--trace directory, aggregated trace.json or simulator trace")
    parser.add_argument("--labels", nargs="+", default=None, help="one per RUN")
    parser.add_argument("--iteration", type=int, default=None,
                        help="draw this iteration only (default: every traced one)")
    parser.add_argument("--title", default=None)
    parser.add_argument("-o", "--output", required=True, help="PNG file to write")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(run).name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
    try:
        plot(args.runs, labels, args.output, args.iteration, args.title)
    except TraceError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
