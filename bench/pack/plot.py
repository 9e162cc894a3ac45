"""Bar chart of max/mean rank cost per method and dataset from pack_bench --csv output.

usage: /usr/bin/python3 bench/pack/plot.py pack.csv out.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    rows = list(csv.DictReader(open(src)))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ys = [next(float(r["max_over_mean"]) for r in rows
                   if r["dataset"] == d and r["method"] == m) for d in datasets]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
        ax.bar(xs, ys, width, label=m)
    ax.axhline(1.005, color="k", linestyle="--", linewidth=0.8, label="target 1.005 x LB (LB=1)")
    ax.set_xticks(range(len(datasets)))
    ax.set_xticklabels(datasets)
    ax.set_ylabel("max / mean rank cost")
    ax.set_yscale("log")
    ax.set_title("bragg-pack: DP imbalance per method (lower is better, 1 is perfect)")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
