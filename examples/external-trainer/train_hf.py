"""An external trainer for bragg-rl (docs/rl.md, "An external trainer"), on Hugging Face
transformers: the shape of what a Megatron-LM loop does, small enough to read.

bragg-rl with ``[train] external = true`` writes each step's batch to
``RUN/batches/step-NNNNNN.jsonl`` (packed THD rows) and waits for the weights of the version the
rows name, a Hugging Face directory renamed whole into ``WEIGHTS/vNNNNNN``. This loop, for each
step in turn:

1. waits for the step's batch file (bragg-rl renames it into place whole);
2. reads its rows with ``bragg_rl.megatron`` (``read_batches``, then ``megatron_batch``: the
   labels, loss mask, advantages and behaviour log-probs aligned as Megatron's loss takes them);
3. computes the policy's log-probs of every trained token with the weights it holds, compares
   them with the behaviour log-probs the engines reported (equal up to float rounding when those
   tokens were sampled by these same weights: ``max_staleness = 0``), takes one
   policy-gradient step (token-mean of ``-advantage * logprob``) with SGD, and measures how far
   the step moved those log-probs;
4. saves the model beside the target and renames it to ``WEIGHTS/v{version:06d}``: bragg-rl sees
   a whole directory or nothing.

The first step starts from ``RUN/models/v0``, the model bragg-rl's fleet starts on. One JSON line
per step goes to ``WEIGHTS/report.jsonl``.

    python train_hf.py RUN_DIR [--weights DIR] [--steps N] [--lr LR] [--temperature T]

Needs torch, transformers, numpy and megatron-core (for ``PackedSeqParams``): the Python peer
environment (python/peers.lock), with ``bragg_rl`` on PYTHONPATH. CPU is enough.
"""

import argparse
import json
import os
import shutil
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from bragg_rl.megatron import megatron_batch, read_batches


def wait_for(path, timeout_s, what):
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            sys.exit(f"train_hf: no {what} at {path} after {timeout_s} s")
        time.sleep(0.1)


def sequences(rows):
    """(tokens, labels, loss_mask, old_logprobs, advantages) of every sequence, [1, n] each:
    one at a time, since transformers' CPU attention takes no packed THD rows."""
    for row in rows:
        batch, _ = megatron_batch(row)
        cu = batch["cu_seqlens"].tolist()
        cup = batch["cu_seqlens_padded"].tolist()
        for k in range(len(cu) - 1):
            a, n = cup[k], cu[k + 1] - cu[k]
            yield tuple(batch[key][:, a:a + n] for key in
                        ("tokens", "labels", "loss_mask", "old_logprobs", "advantages"))


def logprobs(model, ids, labels, temperature):
    logits = model(input_ids=ids).logits.float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def train_step(model, rows, lr, temperature):
    """One SGD step on every row. Returns the loss, the max |policy - behaviour| log-prob
    before the step, the max change of a trained token's log-prob the step made, and the
    trained tokens."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.zero_grad()
    agreement, tokens = 0.0, 0
    terms, before = [], []
    for ids, labels, mask, old, adv in sequences(rows):
        lp = logprobs(model, ids, labels, temperature)
        if mask.sum() > 0:
            agreement = max(agreement, ((lp.detach() - old).abs() * mask).max().item())
        before.append(lp.detach())
        terms.append((-(adv * lp * mask)).sum())
        tokens += int(mask.sum().item())
    loss = torch.stack(terms).sum() / max(tokens, 1)
    loss.backward()
    opt.step()
    change = 0.0
    with torch.no_grad():
        for (ids, labels, mask, _, _), lp0 in zip(sequences(rows), before):
            lp1 = logprobs(model, ids, labels, temperature)
            change = max(change, ((lp1 - lp0).abs() * mask).max().item())
    return loss.item(), agreement, change, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--weights", help="bragg-rl's train.external_weights (default RUN/external)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling.temperature")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for a batch")
    args = ap.parse_args()
    weights = args.weights or os.path.join(args.run_dir, "external")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    start = os.path.join(args.run_dir, "models", "v0")
    wait_for(os.path.join(start, "config.json"), args.timeout, "initial model")
    model = AutoModelForCausalLM.from_pretrained(start, torch_dtype=torch.float32)
    for step in range(1, args.steps + 1):
        path = os.path.join(args.run_dir, "batches", f"step-{step:06d}.jsonl")
        wait_for(path, args.timeout, f"batch for step {step}")
        rows = list(read_batches(path))
        versions = {int(r["version"]) for r in rows}
        if len(versions) != 1:
            sys.exit(f"train_hf: {path} names versions {sorted(versions)}")
        version = versions.pop()
        t0 = time.time()
        loss, agreement, change, tokens = train_step(model, rows, args.lr, args.temperature)
        target = os.path.join(weights, f"v{version:06d}")
        tmp = target + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, safe_serialization=True)
        os.rename(tmp, target)
        line = {"step": step, "version": version, "rows": len(rows), "tokens": tokens,
                "loss": loss, "logprob_agreement_max": agreement,
                "logprob_change_max": change,
                "seconds": round(time.time() - t0, 3)}
        with open(os.path.join(weights, "report.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
