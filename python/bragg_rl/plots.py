"""Curves and a summary of a bragg-rl run, from its ``RUN_DIR/metrics.jsonl``.

    python3 -m bragg_rl.plots RUN_DIR [--compare OTHER_RUN_DIR --labels async,sync]
                              [--target R] [--out DIR] [--summary]

writes into ``--out`` (default RUN_DIR):

- ``reward.png``: ``reward_mean`` and ``success_rate`` against wall-clock (left) and against step
  (right), ``eval_success`` as points where a step has it; with ``--compare`` both runs on the
  same axes, and with ``--target`` a horizontal line at that reward;
- ``staleness.png``: the staleness histogram summed over all steps (trainer version minus the
  oldest version among a trajectory's tokens), one bar per value (per run with ``--compare``);
- ``time_split.png``: where each step's time went (generate, tools, verify, train, sync, wait),
  stacked, one bar per step, or per bin of steps when there are more than 60 (10 steps a bin,
  more when a run is so long that 10 would still draw over 60 bars).

``--summary`` also prints the summary (``summary()``) of each run.

The file: one JSON object a line. A line with an ``"event"`` key (``warm_start``, ``end``, ...) is
an event, kept apart from the steps; every other line is a training step and needs an integer
``step``; every other key is optional (``reward_mean``, ``success_rate``, ``time_s``,
``staleness`` {"0": n, ...}, ``time_split`` {...}, ``eval_success``, ...), a missing one is a gap
in its curve. A run killed mid-write leaves a truncated last line: it is skipped with a
``RuntimeWarning``. A line that does not parse anywhere else means the file is not a metrics file
and raises ``ValueError`` naming the line.

Only numpy and matplotlib (Agg): runs under Debian's ``/usr/bin/python3``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

METRICS_FILE = "metrics.jsonl"
TIME_SPLIT_KEYS = ("generate_s", "tools_s", "verify_s", "train_s", "sync_s", "wait_s")
FINAL_WINDOW = 3  # steps averaged for the final reward and for reaching the target
MAX_BARS = 60  # time_split.png draws at most this many bars

__all__ = [
    "Run",
    "load_run",
    "summary",
    "format_summary",
    "time_to_target",
    "plot_reward",
    "plot_staleness",
    "plot_time_split",
    "write_plots",
    "main",
]


@dataclass
class Run:
    """One run's metrics: ``steps`` in file order, ``events`` (lines with an ``event`` key)."""

    path: str
    steps: List[dict] = field(default_factory=list)
    events: List[dict] = field(default_factory=list)
    truncated_last_line: bool = False

    def column(self, key: str) -> np.ndarray:
        """float64 array of ``key`` over the steps; NaN where a step lacks it (or it is null)."""
        return np.array([_as_float(s.get(key)) for s in self.steps], dtype=np.float64)


def _as_float(value) -> float:
    if isinstance(value, bool) or value is None:
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _metrics_path(run_dir: str) -> str:
    return run_dir if os.path.isfile(run_dir) else os.path.join(run_dir, METRICS_FILE)


def load_run(run_dir: str) -> Run:
    """Reads ``run_dir/metrics.jsonl`` (or ``run_dir`` itself when it is a file).

    Raises FileNotFoundError when there is no metrics file, ValueError for a line other than the
    last that is not a JSON object, or a step line without an integer ``step``. A truncated
    last line is dropped with a RuntimeWarning (``Run.truncated_last_line``).
    """
    path = _metrics_path(run_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(
            "no %s in %s: is it a bragg-rl run directory (the run's metrics_dir)?"
            % (METRICS_FILE, run_dir))
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    # The last element is "" after a final newline; anything else there was cut mid-write.
    while lines and not lines[-1].strip():
        lines.pop()
    run = Run(path=path)
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                warnings.warn("%s:%d: skipping a truncated last line (the run was stopped "
                              "mid-write?): %s" % (path, number, e), RuntimeWarning, stacklevel=2)
                run.truncated_last_line = True
                continue
            raise ValueError("%s:%d: not JSON (%s): is this a bragg-rl metrics file?"
                             % (path, number, e)) from None
        if not isinstance(obj, dict):
            raise ValueError("%s:%d: a metrics line must be a JSON object, got %s"
                             % (path, number, type(obj).__name__))
        if "event" in obj:
            run.events.append(obj)
            continue
        step = obj.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError("%s:%d: a step line needs an integer \"step\" (got %r); event lines "
                             "need an \"event\" key" % (path, number, step))
        run.steps.append(obj)
    return run


def _rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over ``window`` steps, NaN until the window is full or when it holds NaN."""
    out = np.full(values.shape, np.nan)
    for i in range(window - 1, len(values)):
        out[i] = values[i - window + 1:i + 1].mean()
    return out


def time_to_target(run: Run, target: float, window: int = FINAL_WINDOW):
    """(wall-clock seconds, step) of the first step at which the mean ``reward_mean`` of the
    last ``window`` steps (that step included) is >= ``target``; (None, None) if never."""
    rolled = _rolling_mean(run.column("reward_mean"), window)
    times = run.column("time_s")
    for i, value in enumerate(rolled):
        if not math.isnan(value) and value >= target:
            t = times[i]
            return (None if math.isnan(t) else float(t)), int(run.steps[i]["step"])
    return None, None


def staleness_histogram(run: Run) -> Dict[int, int]:
    """Staleness value -> trajectories, summed over all steps; keys that are not integers are
    skipped with a RuntimeWarning."""
    hist: Dict[int, int] = {}
    for s in run.steps:
        per_step = s.get("staleness")
        if not isinstance(per_step, dict):
            continue
        for key, count in per_step.items():
            try:
                k = int(key)
                n = int(count)
            except (TypeError, ValueError):
                warnings.warn("%s: step %s: staleness entry %r: %r is not an integer count"
                              % (run.path, s["step"], key, count), RuntimeWarning, stacklevel=2)
                continue
            hist[k] = hist.get(k, 0) + n
    return dict(sorted(hist.items()))


def _nan_to_none(x: float) -> Optional[float]:
    return None if x is None or math.isnan(x) else float(x)


def _sum_int(run: Run, key: str) -> int:
    return int(sum(v for v in (s.get(key) for s in run.steps)
                   if isinstance(v, (int, float)) and not isinstance(v, bool)))


def _nanmean(values: np.ndarray) -> Optional[float]:
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else None


def summary(run_dir, target: Optional[float] = None) -> dict:
    """The run in numbers. ``run_dir`` is a directory, a metrics file or a ``Run``.

    Keys: ``steps``, ``last_step``, ``wall_s`` (last step's ``time_s``), ``final_reward`` and
    ``final_success`` (means over the last 3 steps, fewer if the run has fewer),
    ``last_eval_success``, ``best_eval_success``, ``target``, ``time_to_target_s`` and
    ``step_to_target`` (``time_to_target``; None when never reached or no target),
    ``over_stale`` (total; must be 0), ``dropped_stale``, ``samples``, ``sandbox_failures``
    (totals), ``staleness`` ({value: trajectories}), ``staleness_mean``, ``time_split_s``
    (totals per phase), ``gen_tokens_per_s``, ``train_tokens_per_s``, ``cache_hit_rate``,
    ``engine_idle_fraction`` (means over steps), ``events`` (event names in order),
    ``truncated_last_line``. Values a run never reported are None.
    """
    run = run_dir if isinstance(run_dir, Run) else load_run(run_dir)
    reward = run.column("reward_mean")
    success = run.column("success_rate")
    evals = run.column("eval_success")
    evals = evals[~np.isnan(evals)]
    hist = staleness_histogram(run)
    trajectories = sum(hist.values())
    split = {k: 0.0 for k in TIME_SPLIT_KEYS}
    for s in run.steps:
        ts = s.get("time_split")
        if isinstance(ts, dict):
            for k in TIME_SPLIT_KEYS:
                v = _as_float(ts.get(k))
                if not math.isnan(v):
                    split[k] += v
    t_target, step_target = (None, None) if target is None else time_to_target(run, target)
    return {
        "path": run.path,
        "steps": len(run.steps),
        "last_step": int(run.steps[-1]["step"]) if run.steps else None,
        "wall_s": _nan_to_none(run.column("time_s")[-1]) if run.steps else None,
        "final_reward": _nanmean(reward[-FINAL_WINDOW:]),
        "final_success": _nanmean(success[-FINAL_WINDOW:]),
        "last_eval_success": float(evals[-1]) if evals.size else None,
        "best_eval_success": float(evals.max()) if evals.size else None,
        "target": target,
        "time_to_target_s": t_target,
        "step_to_target": step_target,
        "over_stale": _sum_int(run, "over_stale"),
        "dropped_stale": _sum_int(run, "dropped_stale"),
        "samples": _sum_int(run, "samples"),
        "sandbox_failures": _sum_int(run, "sandbox_failures"),
        "staleness": hist,
        "staleness_mean": (sum(k * n for k, n in hist.items()) / trajectories
                           if trajectories else None),
        "time_split_s": split,
        "gen_tokens_per_s": _nanmean(run.column("gen_tokens_per_s")),
        "train_tokens_per_s": _nanmean(run.column("train_tokens_per_s")),
        "cache_hit_rate": _nanmean(run.column("cache_hit_rate")),
        "engine_idle_fraction": _nanmean(run.column("engine_idle_fraction")),
        "events": [str(e.get("event")) for e in run.events],
        "truncated_last_line": run.truncated_last_line,
    }


def _fmt(value, spec: str = ".3f", unit: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) + unit


def format_summary(s: dict, label: Optional[str] = None) -> str:
    """A few lines of text for a person, from ``summary()``."""
    head = "%s (%s)" % (label, s["path"]) if label else s["path"]
    if s["target"] is None:
        reached = "-"
    elif s["time_to_target_s"] is None:
        reached = "not reached"
    else:
        reached = "%.1f s (step %d)" % (s["time_to_target_s"], s["step_to_target"])
    split_total = sum(s["time_split_s"].values())
    split = ", ".join("%s %.0f%%" % (k[:-2], 100.0 * v / split_total)
                      for k, v in s["time_split_s"].items()) if split_total > 0 else "-"
    hist = " ".join("%d:%d" % kv for kv in s["staleness"].items()) or "-"
    lines = [
        head,
        "  steps %d (last %s), wall-clock %s" % (s["steps"], _fmt(s["last_step"], "d"),
                                                _fmt(s["wall_s"], ".1f", " s")),
        "  final reward %s, success %s (mean of the last %d steps); eval success last %s, best %s"
        % (_fmt(s["final_reward"]), _fmt(s["final_success"]), FINAL_WINDOW,
           _fmt(s["last_eval_success"]), _fmt(s["best_eval_success"])),
        "  time to reward %s: %s" % (_fmt(s["target"], "g"), reached),
        "  staleness %s (mean %s); over_stale %d%s, dropped_stale %d"
        % (hist, _fmt(s["staleness_mean"], ".2f"), s["over_stale"],
           "" if s["over_stale"] == 0 else " (must be 0)", s["dropped_stale"]),
        "  samples %d, sandbox failures %d, cache hit rate %s, engine idle %s"
        % (s["samples"], s["sandbox_failures"], _fmt(s["cache_hit_rate"], ".2f"),
           _fmt(s["engine_idle_fraction"], ".2f")),
        "  tokens/s generate %s, train %s; time split %s"
        % (_fmt(s["gen_tokens_per_s"], ".0f"), _fmt(s["train_tokens_per_s"], ".0f"), split),
    ]
    if s["events"]:
        lines.append("  events: " + ", ".join(s["events"]))
    if s["truncated_last_line"]:
        lines.append("  (a truncated last line was skipped)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Figures


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _time_axis(runs: Sequence[Run]):
    """(divisor, label): minutes once a run is longer than 10 minutes."""
    longest = 0.0
    for r in runs:
        t = r.column("time_s")
        t = t[~np.isnan(t)]
        if t.size:
            longest = max(longest, float(t.max()))
    return (60.0, "wall-clock (min)") if longest > 600 else (1.0, "wall-clock (s)")


def _no_data(ax, text="no training steps recorded"):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


def plot_reward(runs: Sequence[Run], labels: Sequence[str], out_path: str,
                target: Optional[float] = None) -> str:
    """reward.png: reward_mean (solid), success_rate (dashed), eval_success (points) per run,
    against wall-clock (left) and step (right); a dotted line at ``target``."""
    plt = _pyplot()
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    divisor, t_label = _time_axis(runs)
    drew = False
    for i, (run, label) in enumerate(zip(runs, labels)):
        if not run.steps:
            continue
        drew = True
        color = "C%d" % i
        steps = run.column("step")
        times = run.column("time_s") / divisor
        for ax, x in ((ax_t, times), (ax_s, steps)):
            for key, style, name in (("reward_mean", "-", "reward"),
                                     ("success_rate", "--", "success")):
                y = run.column(key)
                ok = ~np.isnan(y) & ~np.isnan(x)
                if ok.any():
                    ax.plot(x[ok], y[ok], style, color=color, lw=1.6,
                            label="%s %s" % (label, name) if label else name)
            y = run.column("eval_success")
            ok = ~np.isnan(y) & ~np.isnan(x)
            if ok.any():
                ax.plot(x[ok], y[ok], "o", color=color, ms=5, mfc="white", mew=1.5,
                        label="%s eval success" % label if label else "eval success")
    for ax, xlabel in ((ax_t, t_label), (ax_s, "step")):
        if target is not None:
            ax.axhline(target, color="0.3", ls=":", lw=1.2, label="target %g" % target)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if drew:
            ax.legend(fontsize=8, loc="best")
        else:
            _no_data(ax)
    ax_t.set_ylabel("reward mean / success rate")
    ax_t.set_title("against wall-clock")
    ax_s.set_title("against step")
    fig.suptitle("reward: " + " vs ".join(labels) if len(runs) > 1 else "reward: %s" % labels[0])
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def plot_staleness(runs: Sequence[Run], labels: Sequence[str], out_path: str) -> str:
    """staleness.png: trajectories per staleness value over the whole run, bars side by side
    per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    hists = [staleness_histogram(r) for r in runs]
    values = sorted(set(k for h in hists for k in h))
    if values:
        width = 0.8 / len(runs)
        x = np.arange(len(values), dtype=np.float64)
        for i, (h, label) in enumerate(zip(hists, labels)):
            counts = [h.get(v, 0) for v in values]
            bars = ax.bar(x + (i - (len(runs) - 1) / 2) * width, counts, width,
                          color="C%d" % i, label=label)
            ax.bar_label(bars, fontsize=7)
        ax.set_xticks(x)
        ax.set_xticklabels([str(v) for v in values])
        ax.legend(fontsize=8)
    else:
        _no_data(ax, "no staleness recorded")
    ax.set_xlabel("staleness (trainer version - oldest version among a trajectory's tokens)")
    ax.set_ylabel("trajectories trained")
    ax.set_title("staleness, all steps")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def _bin_size(n_steps: int) -> int:
    if n_steps <= MAX_BARS:
        return 1
    return max(10, -(-n_steps // MAX_BARS))


def plot_time_split(runs: Sequence[Run], labels: Sequence[str], out_path: str) -> str:
    """time_split.png: seconds per phase, stacked; per step, or summed per bin of steps when a
    run has more than 60 (``_bin_size``); one panel per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.6 * len(runs)), squeeze=False)
    for ax, run, label in zip(axes[:, 0], runs, labels):
        rows = [s for s in run.steps if isinstance(s.get("time_split"), dict)]
        if not rows:
            _no_data(ax, "no time split recorded")
            ax.set_title(label)
            continue
        split = np.array([[_as_float(s["time_split"].get(k)) for k in TIME_SPLIT_KEYS]
                          for s in rows])
        split = np.nan_to_num(split, nan=0.0)
        steps = np.array([s["step"] for s in rows])
        size = _bin_size(len(rows))
        n_bins = -(-len(rows) // size)
        sums = np.array([split[b * size:(b + 1) * size].sum(axis=0) for b in range(n_bins)])
        x = np.array([steps[b * size] for b in range(n_bins)], dtype=np.float64)
        width = 0.8 * (np.median(np.diff(x)) if len(x) > 1 else 1.0)
        bottom = np.zeros(n_bins)
        for j, key in enumerate(TIME_SPLIT_KEYS):
            ax.bar(x, sums[:, j], width, bottom=bottom, color="C%d" % j, label=key[:-2],
                   align="edge" if size > 1 else "center")
            bottom += sums[:, j]
        ax.set_xlabel("step" if size == 1 else "first step of each %d-step bin" % size)
        ax.set_ylabel("seconds" if size == 1 else "seconds per %d steps" % size)
        ax.set_title("where the time went: %s" % label)
        top = float(bottom.max())
        if top > 0:
            ax.set_ylim(0, top * 1.18)  # room for the legend above the tallest bar
        ax.legend(fontsize=8, ncol=len(TIME_SPLIT_KEYS), loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def write_plots(runs: Sequence[Run], labels: Sequence[str], out_dir: str,
                target: Optional[float] = None) -> List[str]:
    """reward.png, staleness.png and time_split.png into ``out_dir`` (made if missing)."""
    if len(runs) != len(labels):
        raise ValueError("%d runs but %d labels" % (len(runs), len(labels)))
    os.makedirs(out_dir, exist_ok=True)
    return [
        plot_reward(runs, labels, os.path.join(out_dir, "reward.png"), target),
        plot_staleness(runs, labels, os.path.join(out_dir, "staleness.png")),
        plot_time_split(runs, labels, os.path.join(out_dir, "time_split.png")),
    ]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m bragg_rl.plots",
        description="Plots and a summary of a bragg-rl run from RUN_DIR/metrics.jsonl.")
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--compare", metavar="OTHER_RUN_DIR",
                        help="a second run drawn on the same axes (e.g. the synchronous one)")
    parser.add_argument("--labels", help="comma-separated labels of RUN_DIR and OTHER_RUN_DIR "
                        "(default async,sync with --compare, the directory's name otherwise)")
    parser.add_argument("--target", type=float,
                        help="reward to reach: a line on reward.png, time to it in the summary")
    parser.add_argument("--out", help="directory for the PNGs (default RUN_DIR)")
    parser.add_argument("--summary", action="store_true", help="also print a text summary")
    args = parser.parse_args(argv)

    dirs = [args.run_dir] + ([args.compare] if args.compare else [])
    if args.labels:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != len(dirs):
            parser.error("--labels needs %d comma-separated labels, got %r"
                         % (len(dirs), args.labels))
    elif args.compare:
        labels = ["async", "sync"]
    else:
        labels = [os.path.basename(os.path.normpath(args.run_dir)) or args.run_dir]
    try:
        runs = [load_run(d) for d in dirs]
    except (OSError, ValueError) as e:
        print("bragg_rl.plots: %s" % e, file=sys.stderr)
        return 2
    out_dir = args.out or (args.run_dir if os.path.isdir(args.run_dir)
                           else os.path.dirname(os.path.abspath(args.run_dir)))
    try:
        paths = write_plots(runs, labels, out_dir, args.target)
    except OSError as e:
        print("bragg_rl.plots: cannot write the plots into %s: %s" % (out_dir, e), file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    if args.summary:
        for run, label in zip(runs, labels):
            print(format_summary(summary(run, args.target), label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
