#!/usr/bin/python3
"""Judges pack_bench's CSV against pack's targets (bench/verdict.py's rule), prints the targets
table as markdown and writes docs/data/pack.json, which bench/summary.py and the README test read.

usage: /usr/bin/python3 bench/pack/report.py CSV --data OUT.json --date YYYY-MM-DD
                                            --command "..." [--machine "..."]
"""

import argparse
import csv
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from verdict import RULE, Target, shown, spread, verdict  # noqa: E402

PLAN_MS = Target(20.0, "lower")          # 100,000 traces into 512 ranks in <= 20 ms, one core
BALANCE = Target(1.005, "lower")         # max/mean <= LB x 1.005
PADDING = Target(0.2, "lower")           # padding <= 0.2% at alignment 16
BIG = ("lognormal 100k -> 512", "pareto 100k -> 512", "heavy-tail 2% 20-60K 100k -> 512")


def p90(runs):
    """Nearest rank: the smallest run that at least 90% of the runs do not exceed."""
    xs = sorted(runs)
    return xs[max(1, -(-9 * len(xs) // 10)) - 1]


def load(path):
    rows = []
    for r in csv.DictReader(open(path)):
        runs = r.get("plan_ms_runs") or r["plan_ms"]
        rows.append({"dataset": r["dataset"], "method": r["method"],
                     "plan_ms_runs": [float(x) for x in runs.split(";")],
                     "max_over_mean": float(r["max_over_mean"]),
                     "lower_bound": float(r["lower_bound"]),
                     "padding_fraction": float(r["padding_fraction"])})
    return rows


def targets(rows):
    """One entry per (target, bragg row): what the summary and the README test read."""
    out = []
    for r in rows:
        if not r["method"].startswith("bragg"):
            continue
        row = f"{r['dataset']}, {r['method']}"
        if r["dataset"] in BIG:
            lo, med, hi = spread(PLAN_MS, r["plan_ms_runs"])
            out.append({"goal": "plan 100,000 traces into 512 ranks in <= 20 ms on one core",
                        "row": row, "peer": "",
                        "measured": f"median {med:.2f} ms, p90 {p90(r['plan_ms_runs']):.2f} "
                                    f"({lo:.2f}-{hi:.2f} over {len(r['plan_ms_runs'])} runs)",
                        "values": {"min": lo, "median": med, "p90": p90(r["plan_ms_runs"]),
                                   "max": hi},
                        "verdict": verdict(PLAN_MS, r["plan_ms_runs"])})
        ratio = r["max_over_mean"] / r["lower_bound"]
        out.append({"goal": "max/mean <= LB x 1.005", "row": row, "peer": "",
                    "measured": f"{ratio:.4f} x LB (max/mean {r['max_over_mean']:.4f}, "
                                f"LB {r['lower_bound']:.4f})",
                    "values": {"median": ratio},
                    "verdict": verdict(BALANCE, [ratio])})
        pad = 100 * r["padding_fraction"]
        out.append({"goal": "padding <= 0.2% at FP8 alignment 16", "row": row, "peer": "",
                    "measured": f"{pad:.3f}%", "values": {"median": pad},
                    "verdict": verdict(PADDING, [pad])})
    return out


def markdown(tg):
    lines = ["| target | dataset, method | measured | verdict |", "|---|---|---|---|"]
    for t in tg:
        lines.append(f"| {t['goal']} | {t['row']} | {t['measured']} | {shown(t['verdict'])} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--data", required=True)
    ap.add_argument("--date", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--machine", default="")
    args = ap.parse_args()
    rows = load(args.csv)
    tg = targets(rows)
    for t in tg:
        t.update({"part": "pack", "date": args.date, "command": args.command})
    os.makedirs(os.path.dirname(os.path.abspath(args.data)), exist_ok=True)
    with open(args.data + ".tmp", "w") as f:
        json.dump({"meta": {"date": args.date, "command": args.command,
                            "machine": args.machine},
                   "rows": rows, "targets": tg}, f, indent=1)
    os.replace(args.data + ".tmp", args.data)
    print(RULE)
    print()
    print(markdown(tg))
    count = {v: sum(1 for t in tg if t["verdict"] == v) for v in ("met", "missed",
                                                                 "tie (within noise)")}
    print()
    print(f"{len(tg)} target rows: {count['met']} met, {count['missed']} missed, "
          f"{count['tie (within noise)']} tie (within noise).")
    # The median planning time per dataset, for the README (tests/readme_figures_test.py).
    meds = [statistics.median(r["plan_ms_runs"]) for r in rows
            if r["dataset"] in BIG and r["method"] == "bragg lpt+swaps"]
    if meds:
        print(f"\nbragg lpt+swaps (the default) on 100,000 traces: median "
              f"{min(meds):.1f}-{max(meds):.1f} ms.")


if __name__ == "__main__":
    main()
