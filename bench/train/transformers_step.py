"""Hugging Face transformers + torch.optim.AdamW training steps on CPU: the peer of bragg-train's
step benchmark (bench/train/step_bench.cc; bench/train/run.py runs both).

    BRAGG_PEER_PYTHON transformers_step.py MODEL_DIR TRAJECTORIES.jsonl [--threads N]
        [--steps 3] [--warmup 1] [--max-tokens 8192] [--attn sdpa|eager]

The model directory is the one bragg-train loads (Qwen3ForCausalLM or Qwen3MoeForCausalLM via
AutoModelForCausalLM, float32); the trajectories are step_bench's JSONL (docs/train.md format).
A step is the loss bragg-train computes for GRPO with one optimizer step per batch: advantages
normalised within each group, per loss token -min(r A, clip(r, 0.8, 1.28) A) weighted by
min(exp(logp - behaviour), 2) (truncated importance sampling), r = exp(logp - logp.detach()),
summed over the loss tokens and divided by their count; then clip_grad_norm_(1.0) and
torch.optim.AdamW. Batches are the standard Hugging Face way: right-padded with an attention
mask, the trajectories sorted by length (longest first, as Trainer(group_by_length=True) groups
them) and cut into micro-batches whose padded size (rows x longest) stays within --max-tokens;
one forward/backward per micro-batch. Log-probs: the logits' gather minus their logsumexp
(TRL's selective_log_softmax). tokens/s counts the trajectories' tokens, never padding.

Prints one JSON object on stdout; progress on stderr. Runs under the Python peer environment
(BRAGG_PEER_PYTHON, python/peers.lock).
"""

import argparse
import json
import resource
import statistics
import sys
import time

import torch
import transformers


def log(msg):
    print(f"transformers_step: {msg}", file=sys.stderr, flush=True)


def advantages(trajs):
    groups = {}
    for i, t in enumerate(trajs):
        groups.setdefault(t.get("group") or f"__{i}", []).append(i)
    adv = [0.0] * len(trajs)
    for members in groups.values():
        r = torch.tensor([float(trajs[i].get("reward", 0.0)) for i in members],
                         dtype=torch.float64)
        a = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        for k, i in enumerate(members):
            adv[i] = float(a[k])
    return adv


def micro_batches(trajs, max_tokens):
    order = sorted(range(len(trajs)), key=lambda i: -len(trajs[i]["tokens"]))
    batches, cur = [], []
    for i in order:
        longest = len(trajs[cur[0]]["tokens"]) if cur else len(trajs[i]["tokens"])
        if cur and (len(cur) + 1) * longest > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def tensors(trajs, members, adv):
    """input_ids, attention_mask [B, S]; for the S-1 predicted positions: loss mask, behaviour
    log-probs, advantages [B, S-1]."""
    S = max(len(trajs[i]["tokens"]) for i in members)
    B = len(members)
    ids = torch.zeros(B, S, dtype=torch.long)
    attn = torch.zeros(B, S, dtype=torch.long)
    mask = torch.zeros(B, S - 1)
    behaviour = torch.zeros(B, S - 1)
    a = torch.zeros(B, S - 1)
    for b, i in enumerate(members):
        t = trajs[i]
        n = len(t["tokens"])
        ids[b, :n] = torch.tensor(t["tokens"])
        attn[b, :n] = 1
        mask[b, :n - 1] = torch.tensor(t["loss_mask"][1:], dtype=torch.float32)
        behaviour[b, :n - 1] = torch.tensor(t["logprobs"][1:], dtype=torch.float32)
        a[b, :] = adv[i]
    return ids, attn, mask, behaviour, a


def step(model, optimizer, batches, loss_tokens):
    total = 0.0
    for ids, attn, mask, behaviour, a in batches:
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1, :]
        targets = ids[:, 1:]
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
        ratio = torch.exp(logp - logp.detach())
        clipped = torch.clamp(ratio, 1 - 0.2, 1 + 0.28)
        surrogate = torch.min(ratio * a, clipped * a)
        weight = torch.clamp_max(torch.exp(logp.detach() - behaviour), 2.0)
        loss = (-weight * surrogate * mask).sum() / loss_tokens
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("trajectories")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=torch.float32, attn_implementation=args.attn)
    model.train()
    with open(args.trajectories) as f:
        trajs = [json.loads(line) for line in f if line.strip()]
    adv = advantages(trajs)
    groups = micro_batches(trajs, args.max_tokens)
    batches = [tensors(trajs, g, adv) for g in groups]
    tokens = sum(len(t["tokens"]) for t in trajs)
    padded = sum(b[0].numel() for b in batches)
    loss_tokens = sum(sum(t["loss_mask"][1:]) for t in trajs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0)
    runs = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        loss = step(model, optimizer, batches, loss_tokens)
        s = time.perf_counter() - start
        log(f"step {i}{' (warm-up)' if i < args.warmup else ''}: {s:.3f} s, "
            f"{tokens / s:.0f} tokens/s, loss {loss:.5f}")
        if i >= args.warmup:
            runs.append(s)
    median = statistics.median(runs)
    print(json.dumps({
        "threads": args.threads, "max_tokens": args.max_tokens, "trajectories": len(trajs),
        "tokens": tokens, "padded_tokens": padded, "micro_batches": len(batches),
        "attn_implementation": model.config._attn_implementation,
        "model_class": type(model).__name__,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "parallel_info": torch.__config__.parallel_info().splitlines()[:6],
        "step_seconds": runs, "median_step_seconds": median, "tokens_per_second": tokens / median,
        "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }))


if __name__ == "__main__":
    main()
