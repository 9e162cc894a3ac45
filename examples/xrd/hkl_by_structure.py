#!/usr/bin/env python3
"""What the policy chose, per structure, over a bragg-rl run on the xrd task.

    hkl_by_structure.py RUN_DIR DATA_DIR [--bucket N]

Reads RUN_DIR/rollouts.jsonl (every finished training rollout; eval rollouts are left out) and
DATA_DIR's prompts.jsonl / heldout.jsonl (each prompt's structure), and prints, per N weight
versions (a rollout counts at the version it started on): the mean sampled reward, the share of
rollouts whose bragg call was malformed ("?"), and per structure (its right hkl in brackets) the
share of each hkl chosen.
"""

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox"))

from tool_server import FIRST_HKL  # noqa: E402


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def chosen_hkl(turns):
    """The hkl of the rollout's bragg call ("bragg A HKL TUBE"), "?" if it has none."""
    if len(turns) > 1 and turns[1].startswith("bragg "):
        parts = turns[1].split()
        if len(parts) == 4:
            return parts[2]
    return "?"


def table(rollouts, structure_of, bucket):
    rows = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))
    rewards = collections.defaultdict(list)
    for r in rollouts:
        if "-eval-" in r["id"]:
            continue
        b = (r.get("versions") or [0, 0])[0] // bucket
        rewards[b].append(r["reward"])
        rows[b][structure_of[r["prompt"]]][chosen_hkl(r["turns"])] += 1
    lines = []
    for b in sorted(rows):
        n = len(rewards[b])
        bad = sum(c["?"] for c in rows[b].values())
        cells = []
        for structure, counts in sorted(rows[b].items()):
            total = sum(counts.values())
            shares = " ".join("%s:%.2f" % (h, c / total) for h, c in sorted(counts.items()))
            cells.append("%s(%s) %s" % (structure, FIRST_HKL[structure], shares))
        lines.append("v%d-%d reward %.3f n %d malformed %.2f | %s" % (
            b * bucket, b * bucket + bucket - 1, sum(rewards[b]) / n, n, bad / n,
            " | ".join(cells)))
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--bucket", type=int, default=25, help="weight versions per row")
    args = ap.parse_args()
    if args.bucket < 1:
        ap.error("--bucket must be >= 1")
    structure_of = {}
    for name in ("prompts.jsonl", "heldout.jsonl"):
        for p in read_jsonl(os.path.join(args.data_dir, name)):
            structure_of[p["prompt"]] = p["meta"]["structure"]
    for line in table(read_jsonl(os.path.join(args.run_dir, "rollouts.jsonl")), structure_of,
                      args.bucket):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
