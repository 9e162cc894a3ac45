#!/usr/bin/python3
"""The README's benchmark figures, from docs/data (the same data as docs/benchmarks.md's summary).

Each figure sits in the README between `<!-- fig:NAME -->` and `<!-- /fig -->` (HTML comments:
invisible on GitHub). This script rewrites them from the data, or with --check exits 1 naming
every figure that disagrees, every marker whose name it does not know (KNOWN) and every figure
it knows that the README lacks (tests/readme_figures_test.py runs the check). A manual target's
figure is its `measured` text in docs/data/manual_targets.json, the verdict bench/summary.py
gives it and its date.

    bench/readme_figures.py [--readme README.md] [--data docs/data] [--check]
"""

import argparse
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import summary  # noqa: E402
from verdict import MET, MISSED, TIE  # noqa: E402

FIG = re.compile(r"<!-- fig:([a-z0-9-]+) -->(.*?)<!-- /fig -->", re.S)
BIG = ("lognormal 100k -> 512", "pareto 100k -> 512", "heavy-tail 2% 20-60K 100k -> 512")

# The README's figures of manual targets: name, the target's goal in
# docs/data/manual_targets.json (its key there) and the target in a few words.
MANUAL = (
    ("reshard-memory", "peak RSS within the 1 GiB memory budget, flat with model size",
     "<= 1 GiB, flat with model size"),
    ("reshard-memory-16gb", "peak RSS within the 1 GiB memory budget at 16 GB", "<= 1 GiB"),
    ("reshard-bandwidth", "throughput >= 80% of the disk's read bandwidth", ">= 80%"),
    ("reshard-speed", ">= 10x the torch reference converter (llama, on disk)", ">= 10x"),
    ("reshard-moe", ">= 10x the torch reference converter (DeepSeek-V3-shaped MoE)", ">= 10x"),
    ("gateway-overhead-p50", "overhead p50 <= 50 us at >= 20,000 requests/s (quiet machine)",
     "<= 50 us"),
    ("gateway-overhead-p99", "overhead p99 <= 300 us at >= 20,000 requests/s (quiet machine)",
     "<= 300 us"),
    ("gateway-rate", ">= 20,000 requests/s through the gateway (quiet machine)",
     ">= 20,000/s"),
    ("gateway-oracle", "sticky routing's hit rate >= 95% of a same-memory oracle",
     ">= 95%"),
    ("gateway-round-robin", "sticky routing's hit rate >= 5x round-robin's", ">= 5x"),
)

# Every figure this script writes; a README marker with another name fails the check, and so
# does a README that lacks one of these.
KNOWN = (("pack-plan", "pack-balance", "pack-padding", "pbox-native", "pbox-gvisor",
          "engine-decode", "engine-prefill", "train-step", "train-memory", "train-dp",
          "train-parity", "rl-controller", "rl-async", "rl-demo",
          "gateway-sglang-router") + tuple(name for name, _, _ in MANUAL))


def _load(data_dir, name):
    path = os.path.join(data_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _tally(verdicts):
    """"met" / "missed" / "a tie (within noise)" for one, or the counts for several."""
    if len(set(verdicts)) == 1:
        v = verdicts[0]
        return {MET: "met", MISSED: "missed", TIE: TIE}[v] + (
            f" in all {len(verdicts)}" if len(verdicts) > 1 else "")
    parts = [f"{verdicts.count(v)} {v}" for v in (MET, TIE, MISSED) if verdicts.count(v)]
    return ", ".join(parts)


def _rng(lo, hi, fmt):
    a, b = format(lo, fmt), format(hi, fmt)
    return a if a == b else f"{a}-{b}"


def pack_figures(data):
    rows = data["rows"]
    date = data["meta"]["date"]

    def med(method):
        return [statistics.median(r["plan_ms_runs"]) for r in rows
                if r["dataset"] in BIG and r["method"] == method]

    plan = [t for t in data["targets"] if "20 ms" in t["goal"]
            and t["row"].split(", ", 1)[1] in ("bragg lpt+swaps", "bragg lpt+swaps (FP8 per row)")]
    default, per_row = med("bragg lpt+swaps"), med("bragg lpt+swaps (FP8 per row)")
    nruns = len(rows[0]["plan_ms_runs"])
    figs = {
        "pack-plan": (f"in a median {_rng(min(default), max(default), '.1f')} ms on one core "
                      f"({_rng(min(per_row), max(per_row), '.1f')} ms with FP8 aligned per packed "
                      f"row; the 20 ms target {_tally([t['verdict'] for t in plan])} by "
                      f"bench/verdict.py's rule; {nruns} runs each, {date})"),
    }
    lpt = [r for r in rows if r["method"] == "bragg lpt+swaps"]
    worst = max(r["max_over_mean"] / r["lower_bound"] for r in lpt)
    figs["pack-balance"] = f"max/mean within {100 * (worst - 1):.2f}% of the lower bound"
    row_pad = [100 * r["padding_fraction"] for r in rows
               if r["method"] == "bragg lpt+swaps (FP8 per row)"]
    trace_pad = [100 * r["padding_fraction"] for r in lpt]
    figs["pack-padding"] = (f"{_rng(min(row_pad), max(row_pad), '.3f')}% with FP8 aligned per "
                            f"packed row (`--fp8-align row`), "
                            f"{_rng(min(trace_pad), max(trace_pad), '.2f')}% with every trace "
                            "aligned")
    return figs


def pbox_figures(data):
    date = data["meta"]["date"].split(" ")[0]
    tg = data.get("targets", [])
    native = [t for t in tg if not t["goal"].startswith("create p50 no worse than")]
    gvisor = [t for t in tg if t["goal"].startswith("create p50 no worse than")]
    figs = {}
    if native:
        v = [t["verdict"] for t in native]
        odd = [f"{t['goal']}: {t['verdict']}" for t in native if t["verdict"] != MET]
        figs["pbox-native"] = (f"{v.count(MET)} of {len(v)} native-runtime speed targets met"
                               + (f" ({'; '.join(odd)})" if odd else "") + f", {date}")
    if gvisor:
        meds = [t["values"]["median"] for t in gvisor]
        figs["pbox-gvisor"] = (f"create is {_rng(min(meds), max(meds), '.2f')}x `runsc` started "
                               f"by hand (medians over {len(gvisor)} peer shapes; verdicts: "
                               f"{_tally([t['verdict'] for t in gvisor])}; {date})")
    return figs


def engine_figures(data):
    """bench/engine/run.py's decode targets and its long prefill (no target)."""
    date = str(data.get("date", "")).split(" ")[0]
    threads = data.get("args", {}).get("threads")
    cores = f" on {threads} cores" if threads else ""
    parts = []
    for t in sorted(data.get("targets", []), key=lambda t: t.get("batch", 0)):
        if "bounds" not in t:
            continue
        lo, mid, hi = t["bounds"]
        n = t["batch"]
        parts.append(f"{mid:.2f}x at {n} concurrent request{'s' if n != 1 else ''} "
                     f"({lo:.2f}-{hi:.2f}x over the runs; target {t['ratio']:g}x: "
                     f"{t['verdict']})")
    figs = {}
    if parts:
        figs["engine-decode"] = (f"tokens/s {', '.join(parts)} against transformers' "
                                 f"`generate()`{cores}, {date}")
    pre = data.get("summary", {}).get("prefill_tokens_per_s", {})
    ours, peer = pre.get("engine"), pre.get("transformers")
    if ours and peer:
        ratio = statistics.median(ours) / statistics.median(peer)
        figs["engine-prefill"] = (
            f"{ratio:.2f}x transformers' tokens/s on a {data['args']['prefill_tokens']:,}-token "
            f"prompt ({min(ours) / max(peer):.2f}-{max(ours) / min(peer):.2f}x over the runs; "
            f"no target){cores}, {date}")
    return figs


def train_figures(data):
    """bench/train/run.py's step speed, memory and data-parallel targets."""
    date = str(data.get("date", "")).split(" ")[0]
    threads = data.get("args", {}).get("threads")
    cores = f" on {threads} cores" if threads else ""
    t = {(x["kind"], x.get("key")): x for x in data.get("targets", [])}
    figs = {}
    peer, padded = t.get(("speed", "transformers")), t.get(("speed", "bragg/padded"))
    if peer and padded:
        figs["train-step"] = (
            f"a training step's tokens/s {peer['spread'][1]:.2f}x transformers + torch AdamW's "
            f"({peer['spread'][0]:.2f}-{peer['spread'][2]:.2f}x over the runs: "
            f"{peer['verdict']}) and {padded['spread'][1]:.2f}x the same batches padded "
            f"({padded['verdict']}){cores}, {date}")
    mem = next((x for x in data.get("targets", []) if x["kind"] == "memory"), None)
    if mem:
        figs["train-memory"] = (f"a step's peak RSS at V = 151,936, fused against unfused, "
                                f"{mem['measured']} ({mem['verdict']}), {date}")
    ratio, step = t.get(("dp", "time_max_over_mean")), t.get(("dp", "step_seconds"))
    if ratio and step:
        figs["train-dp"] = (
            f"with 2 ranks the cost-aware plan's max/mean rank time is {ratio['spread'][1]:.2f}x "
            f"round-robin's ({ratio['verdict']}) and its step time {step['spread'][1]:.2f}x "
            f"({step['verdict']}), {str(ratio.get('date') or date).split(' ')[0]}")
    return figs


def train_parity_figures(data):
    """bench/train/parity.py: trainer against engine log-probs in the default arithmetic."""
    date = str(data.get("date", "")).split(" ")[0]
    by = {r["config"]: r for r in data.get("results", [])}

    def worst(names):
        rs = [by[n] for n in names if n in by]
        return max(r["max"] for r in rs), {r["verdict"] for r in rs}

    if not {"dense FP32", "MoE FP32", "dense BF16", "MoE BF16"} <= set(by):
        return {}
    f32, v32 = worst(["dense FP32", "MoE FP32"])
    b16, v16 = worst(["dense BF16", "MoE BF16"])
    return {"train-parity": (
        f"differ by at most {f32:.1e} at FP32 and {b16:.2f} at BF16 (targets 1e-5: "
        f"{', '.join(sorted(v32))}; 0.1: {', '.join(sorted(v16))}), {date}")}


def gateway_sglang_router_figures(data):
    """bench/gateway/sglang_router.py's targets beside sgl-router."""
    date = str(data.get("date", "")).split(" ")[0]
    v = {t["goal"]: t["verdict"] for t in data.get("targets", [])}
    goals = ("proxy overhead p50 below sgl-router's at every rate",
             "proxy overhead p99 below sgl-router's at every rate",
             "own miss tokens <= 1/5 of round robin's",
             "own miss tokens below sgl-router cache_aware's")
    if not set(goals) <= set(v):
        return {}

    def own(router):
        return statistics.median(r["own_miss_tokens"] for r in data["cache"][router])

    ours, aware, rr = own("bragg sticky"), own("sgl cache_aware"), own("sgl round_robin")
    return {"gateway-sglang-router": (
        f"proxy overhead p50 and p99 below sgl-router's at every rate ({v[goals[0]]}, "
        f"{v[goals[1]]}); rollouts' own prefill misses {ours:,.0f} tokens against sgl-router "
        f"cache_aware's {aware:,.0f} (target fewer: {v[goals[3]]}) and {ours / rr:.2f}x "
        f"round-robin's (target <= 0.2x: {v[goals[2]]}), {date}")}


def manual_figures(data):
    """The targets of docs/data/manual_targets.json in MANUAL, judged as bench/summary.py
    judges them."""
    judged = {t["goal"]: (t, r) for t, r in zip(data["targets"], summary.manual_rows(data))}
    figs = {}
    for name, goal, target in MANUAL:
        if goal in judged:
            t, r = judged[goal]
            figs[name] = (f"{t['measured']} (target {target}: {r['verdict']}; manual run, "
                          f"{t['date']})")
    return figs


def rl_figures(data):
    """bench/rl/run.py's controller overhead."""
    date = str(data.get("date", "")).split(" ")[0]
    t = {x["key"]: x for x in data.get("targets", [])}
    if not {"turns_per_cpu_s", "cpu_ratio", "memory_ratio"} <= set(t):
        return {}
    kib = statistics.median(r["bytes_per_loop"] for r in data["runs"]["controller"]) / 1024
    return {"rl-controller": (
        f"{data['args']['loops']:,} concurrent loops: "
        f"{t['turns_per_cpu_s']['spread'][1]:,.0f} turns per controller CPU-second "
        f"({t['turns_per_cpu_s']['verdict']} for >= 1,000), CPU per turn "
        f"{t['cpu_ratio']['spread'][1]:.2f}x the bare /generate calls' "
        f"({t['cpu_ratio']['verdict']} for <= 1.5x), {kib:,.0f} KiB per live rollout, {date}")}


def rl_async_figures(data):
    """bench/rl/async_sync.py's pairs."""
    date = str(data.get("date", "")).split(" ")[0]
    t = {x["key"]: x for x in data.get("targets", [])}
    if not {"speedup", "step_rate"} <= set(t):
        return {}
    return {"rl-async": (
        f"asynchronous RL trains {t['step_rate']['spread'][1]:.2f}x the steps per second of "
        f"synchronous ({t['step_rate']['verdict']}) and reaches reward {data['args']['target']:g} "
        f"{t['speedup']['spread'][1]:.2f}x sooner at the median "
        f"({t['speedup']['verdict']}; {len(data['runs']['async'])} seed pairs, {date})")}


def rl_demo_figures(data):
    """What the demo task's runs in bench/rl/async_sync.py learned (both modes, every seed)."""
    date = str(data.get("date", "")).split(" ")[0]
    runs = data.get("runs", {}).get("async", []) + data.get("runs", {}).get("sync", [])
    if not runs:
        return {}
    first = statistics.median(r["reward_first3"] for r in runs)
    last = [r["reward_last3"] for r in runs]
    steps = [r["steps"] for r in runs]
    before = statistics.median(r["eval_before"] for r in runs)
    after = [r["eval_after"] for r in runs]
    return {"rl-demo": (
        f"sampled reward {first:.2f} → {_rng(min(last), max(last), '.2f')} (the runs' target "
        f"{data['args']['target']:g}) in {_rng(min(steps), max(steps), 'd')} steps, greedy "
        f"held-out success {before:.2f} → {_rng(min(after), max(after), '.2f')} "
        f"({len(runs)} runs, {date})")}


def expected(data_dir):
    """{figure name: text} for every figure the data in data_dir supports."""
    figs = {}
    for name, fn in (("pack.json", pack_figures), ("pbox_bench.json", pbox_figures),
                     ("engine.json", engine_figures), ("train.json", train_figures),
                     ("train_parity.json", train_parity_figures), ("rl.json", rl_figures),
                     ("rl_async.json", rl_async_figures), ("rl_async.json", rl_demo_figures),
                     ("gateway_sglang_router.json", gateway_sglang_router_figures),
                     ("manual_targets.json", manual_figures)):
        data = _load(data_dir, name)
        if data is not None:
            figs.update(fn(data))
    unknown = set(figs) - set(KNOWN)
    assert not unknown, f"figures missing from KNOWN: {sorted(unknown)}"
    return figs


def disagreements(readme_text, figs):
    """Messages for every README figure that is not what the data gives, whose name is not in
    KNOWN or that appears twice, and for every figure in KNOWN that the README lacks."""
    out, seen = [], set()
    for m in FIG.finditer(readme_text):
        name, text = m.group(1), m.group(2)
        if name in seen:
            out.append(f"README figure {name!r} appears more than once")
        seen.add(name)
        if name not in KNOWN:
            out.append(f"README figure {name!r} is not one bench/readme_figures.py knows "
                       f"({', '.join(KNOWN)})")
        elif name not in figs:
            out.append(f"README figure {name!r} has no data behind it in docs/data")
        elif text != figs[name]:
            out.append(f"README figure {name!r} says {text!r}, docs/data says {figs[name]!r}")
    for name in KNOWN:
        if name not in seen:
            out.append(f"README lacks the figure {name!r} (<!-- fig:{name} -->...<!-- /fig -->)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--data", default=os.path.join(ROOT, "docs/data"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    figs = expected(args.data)
    text = open(args.readme).read()
    if args.check:
        bad = disagreements(text, figs)
        if bad:
            sys.exit("\n".join(bad) + "\n(run bench/readme_figures.py to rewrite them)")
        return
    new = FIG.sub(lambda m: (f"<!-- fig:{m.group(1)} -->{figs[m.group(1)]}<!-- /fig -->"
                             if m.group(1) in figs else m.group(0)), text)
    with open(args.readme + ".tmp", "w") as f:
        f.write(new)
    os.replace(args.readme + ".tmp", args.readme)


if __name__ == "__main__":
    main()
