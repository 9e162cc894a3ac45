#!/usr/bin/python3
"""How fast a decode step of the engine benchmark's model can be on this machine, from two
measured limits, against the step time of transformers' generate() that bench/engine/run.py
measured (docs/data/engine.json): the largest engine / transformers decode ratio the machine
allows at each batch.

    bench/engine/decode_floor.py [--threads 2] [--data docs/data/engine.json] [--build build]

Runs with the torch the interpreter has: Debian's python3-torch under /usr/bin/python3 (the
engine's torch 1.13 and the system's BLAS), else the Python peer environment's (MKL;
machine.peer_python: $BRAGG_PEER_PYTHON, the build's cache entry, or install-deps' default; it
re-executes itself there), pinned to the first --threads CPUs. Debian's GEMM was the faster
here, so it gives the lower floor. OpenBLAS 0.3.21 does not know CPUs newer than it and falls
back to its slowest kernels there; the script names the core as bragg-engine does, through the
build's bragg_train (`use_known_blas_core`, common/blas_core.h). A step must at least:

- multiply the batch's hidden states by the output embedding (lm_head, [32000, 256] fp32): the
  one product that does not shrink with the batch, at this machine's best GEMM rate (a
  2048 x 2048 x 2048 product, the best of 5; a small-batch GEMM from a library is slower than
  that: it packs the weight on every call, which the engine's packed lm_head does not);
- read every weight the step uses once: the attention and router weights of the 4 layers, and
  the weights of every expert some row is routed to (2 of each layer's 16 for one request,
  nearly all 16 from 32 requests on), and the lm_head, at this machine's read bandwidth
  (torch.sum over 1 GiB, the best of 5);
- read every request's cached keys and values once per layer: at the benchmark's mean
  position (its prompt plus half its new tokens, from docs/data/engine.json's args), 512 bytes
  a position and layer for this model.

Floor = lm_head arithmetic + (weights + KV cache) / bandwidth (as if the two did not overlap).
Norms, sampling and the scheduler come on top; the ratio it allows is an upper bound only as
far as arithmetic and reads cannot overlap.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from machine import (child_env, peer_python, pin_prefix,  # noqa: E402  (bench/machine.py)
                     pinned_cpus)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The benchmark model (engine_bench --write-model).
VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K, MOE_I = 32000, 256, 4, 16, 2, 256
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32


def expert_bytes(batch):
    """Bytes of expert weights a step reads: the experts per layer a batch of this size routes
    to, in expectation E (1 - (1 - k/E)^batch) for uniform routing."""
    per_expert = (HIDDEN * 2 * MOE_I + MOE_I * HIDDEN) * 4
    distinct = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** batch)
    return LAYERS * distinct * per_expert


def lm_head_bytes():
    return VOCAB * HIDDEN * 4


def use_known_blas_core(build):
    """Names OpenBLAS's core as bragg-engine does (common/blas_core.h), through the build's
    bragg_train (bragg_train.use_known_blas_core); without that build, leaves OpenBLAS's own
    choice and says so."""
    sys.path.insert(0, os.path.join(os.path.abspath(build), "python"))
    try:
        import bragg_train
        bragg_train.use_known_blas_core()
    except (ImportError, RuntimeError) as e:
        print(f"decode_floor: OpenBLAS's own choice of kernels ({build}'s bragg_train: {e})",
              file=sys.stderr)
    finally:
        sys.path.pop(0)


def kv_bytes(batch, mean_position):
    """Bytes of cached keys and values a decode step's attention reads."""
    return batch * mean_position * LAYERS * KV_HEADS * HEAD_DIM * 2 * 4


def dense_bytes():
    attn = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2
    router = EXPERTS * HIDDEN
    return LAYERS * (attn + router) * 4


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build", default="build", help="for the peer environment's path")
    ap.add_argument("--data", default=os.path.join(ROOT, "docs/data/engine.json"))
    args = ap.parse_args()
    use_known_blas_core(args.build)  # before torch loads OpenBLAS
    try:
        import torch
    except ImportError:
        peer = peer_python(args.build)
        # A venv's python is a link to the system's: tell them apart by sys.prefix.
        in_peer = os.path.realpath(sys.prefix) == os.path.realpath(
            os.path.dirname(os.path.dirname(peer)))
        if in_peer or not os.path.exists(peer):
            sys.exit("decode_floor: torch is not importable here and no peer environment at "
                     f"{peer} (scripts/install-deps)")
        argv = pin_prefix(pinned_cpus(args.threads)) + [peer] + sys.argv
        os.execvpe(argv[0], argv, child_env(args.threads))
    os.sched_setaffinity(0, pinned_cpus(args.threads))
    torch.set_num_threads(args.threads)
    with open(args.data) as f:
        data = json.load(f)
    hf = data["summary"]["decode"]["transformers"]

    big = torch.ones(256 << 20)  # 1 GiB of fp32
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.sum(big)
        best = min(best, time.perf_counter() - t)
    bandwidth = big.numel() * 4 / best
    del big

    a = torch.randn(2048, 2048)
    b = torch.randn(2048, 2048)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    rate = 2048 ** 3 / best  # multiply-adds per second
    del a, b

    rows = []
    mean_position = data["args"]["prompt_tokens"] + data["args"]["new_tokens"] / 2
    for batch in data["batches"]:
        lm_head = batch * HIDDEN * VOCAB / rate
        weights = expert_bytes(batch) + dense_bytes() + lm_head_bytes()
        kv = kv_bytes(batch, mean_position)
        floor = lm_head + (weights + kv) / bandwidth
        hf_step = batch / statistics.median(hf[str(batch)])
        ours = batch / statistics.median(data["summary"]["decode"]["engine"][str(batch)])
        rows.append((batch, lm_head, weights, kv, floor, hf_step, ours))

    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    print(f"torch {torch.__version__} ({sys.executable}, BLAS {blas.group(1) if blas else '?'}),"
          f" {args.threads} threads; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (torch.sum over 1 GiB, best of 5); GEMM "
          f"{rate * 2 / 1e9:.0f} GFLOP/s (2048^3, best of 5); OPENBLAS_CORETYPE="
          f"{os.environ.get('OPENBLAS_CORETYPE', '')}")
    print("| concurrent requests | lm_head arithmetic ms | weights read MB | KV cache read MB | "
          "floor ms per step | "
          "bragg-engine ms per step | transformers ms per step | largest engine / "
          "transformers ratio | engine / transformers now |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, lm_head, weights, kv, floor, hf_step, ours in rows:
        print(f"| {batch} | {lm_head * 1e3:.2f} | {weights / 1e6:.1f} | {kv / 1e6:.1f} | "
              f"{floor * 1e3:.2f} | "
              f"{ours * 1e3:.2f} | {hf_step * 1e3:.2f} | {hf_step / floor:.2f}x | "
              f"{hf_step / ours:.2f}x |")


if __name__ == "__main__":
    main()
