"""Bar charts of max/mean rank cost and of padding per method and dataset from pack_bench --csv
output.

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
    fig, (ax, pad) = plt.subplots(2, 1, figsize=(10, 8))
    width = 0.8 / len(methods)

    def value(d, m, key):
        return next(float(r[key]) for r in rows if r["dataset"] == d and r["method"] == m)

    for j, m in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
        ax.bar(xs, [value(d, m, "max_over_mean") for d in datasets], width, label=m)
        pad.bar(xs, [100 * value(d, m, "padding_fraction") for d in datasets], width, label=m)
    ax.axhline(1.005, color="k", linestyle="--", linewidth=0.8, label="target 1.005 x LB (LB=1)")
    ax.set_xticks(range(len(datasets)))
    ax.set_xticklabels(datasets)
    ax.set_ylabel("max / mean rank cost")
    ax.set_yscale("log")
    ax.set_title("bragg-pack: DP imbalance per method (lower is better, 1 is perfect)")
    ax.legend(fontsize=8, ncol=2)
    pad.axhline(0.2, color="k", linestyle="--", linewidth=0.8, label="target 0.2%")
    pad.set_xticks(range(len(datasets)))
    pad.set_xticklabels(datasets)
    pad.set_ylabel("padding, % of tokens (log)")
    pad.set_yscale("log")
    pad.set_title("padding at FP8 alignment 16, per trace or per row (lower is better; "
                  "colours as above)")
    pad.legend(handles=pad.get_lines(), fontsize=8, loc="center left")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
