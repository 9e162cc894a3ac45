"""A plan whose first micro-batch count almost fills the capacity: 100,000 lognormal traces into
512 ranks, max_tokens chosen so that the smallest count per rank is 99.95% full. The ranks
balance at that count, but some rank's traces then do not split into its micro-batches, so the
planner balances again with one more micro-batch per rank. Prints one markdown table row per
FP8 alignment: plan time (median and best of N runs) and max/mean against the lower bound.

usage: PYTHONPATH=BUILD/python /usr/bin/python3 bench/pack/tight.py [--repeat N]
"""

import argparse
import statistics

import numpy as np

import bragg_pack as bp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=21)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(np.log(2048), 1.0, 100000), 64, 65536).astype(np.int64)
    a, b = bp.cost_model_from_model_size(4096, 32)
    dp, m = 512, 5
    print("| FP8 alignment | max_tokens | first count's fill | micro-batches/rank | plan ms "
          "(median of %d) | plan ms (best) | max/mean | LB |" % args.repeat)
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for align in ("trace", "row"):
        a_trace = bp.alignment(fp8=True, fp8_align=align)
        row_align = bp.row_alignment(fp8=True, fp8_align=align)
        padded = int(((lengths + a_trace - 1) // a_trace * a_trace).sum())
        cap = int(padded / dp / m / 0.9995) // row_align * row_align
        runs, s = [], None
        for _ in range(args.repeat):
            p = bp.plan(lengths, dp=dp, max_tokens=cap, fp8=True, fp8_align=align,
                        cost_a=a, cost_b=b)
            s = p.summary
            runs.append(s["plan_ms"])
        print(f"| {align} | {cap} | {padded / (dp * m * cap):.4%} | "
              f"{s['micro_batches_per_rank']} | {statistics.median(runs):.2f} | {min(runs):.2f} | "
              f"{s['max_over_mean']:.4f} | {s['lower_bound']:.4f} |")


if __name__ == "__main__":
    main()
