"""Hugging Face transformers' generate() on CPU: the peer bragg-engine's benchmark runs beside it.

    BRAGG_PEER_PYTHON transformers_generate.py MODEL_DIR [--threads N] [--batches 1,8,32,64]
        [--prompt-tokens 128] [--new-tokens 128] [--prefill-tokens 4096] [--dtype ...]

Prints one JSON object:
  decode   for each batch size: a left-padded batch of random prompts (--prompt-tokens each),
           --new-tokens greedy tokens (never stopped early); decode tokens/s is the batch's new
           tokens after the first, over the time past the first (measured by a run of one token)
  prefill  one prompt of --prefill-tokens: time to first token (a generate() of one token) and
           prompt tokens/s
Runs under the Python peer environment (BRAGG_PEER_PYTHON, python/peers.lock).
"""

import argparse
import json
import os
import sys
import time

import torch
import transformers


def timed_generate(model, ids, new_tokens):
    mask = torch.ones_like(ids)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                         temperature=None, top_p=None, top_k=None)
    seconds = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens, "generate() stopped early"
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batches", default="1,8,32,64", help="comma-separated batch sizes")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="0: skip the prefill run")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the checkpoint's")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.new_tokens < 2:
        sys.exit("--new-tokens must be at least 2 (decode speed is measured past the first)")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype) if args.dtype else "auto"
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    config = model.config
    context = getattr(config, "max_position_embeddings", None)
    need = max(args.prompt_tokens + args.new_tokens, args.prefill_tokens + 1)
    if context is not None and need > context:
        sys.exit(f"{args.model_dir}: context {context} < {need} tokens this run needs; lower "
                 "--prefill-tokens / --prompt-tokens / --new-tokens")
    vocab = config.vocab_size

    result = {"engine": "transformers", "transformers": transformers.__version__,
              "torch": torch.__version__, "model": os.path.abspath(args.model_dir),
              "architecture": config.architectures[0] if config.architectures else None,
              "dtype": str(model.dtype).replace("torch.", ""), "threads": args.threads,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "decode": [], "prefill": None}
    with torch.inference_mode():
        timed_generate(model, torch.randint(0, vocab, (1, 8)), 2)  # warm-up
        for batch in [int(b) for b in args.batches.split(",") if b]:
            # Random prompts of one length: left padding (transformers' rule for batched
            # decoder-only generation) would add nothing, so the mask is all ones.
            ids = torch.randint(0, vocab, (batch, args.prompt_tokens))
            first = timed_generate(model, ids, 1)
            total = timed_generate(model, ids, args.new_tokens)
            decode_s = max(total - first, 1e-9)
            result["decode"].append({
                "batch": batch, "seconds": total, "first_token_s": first,
                "decode_tokens_per_s": batch * (args.new_tokens - 1) / decode_s,
                "tokens_per_s": batch * args.new_tokens / total})
        if args.prefill_tokens:
            ids = torch.randint(0, vocab, (1, args.prefill_tokens))
            ttft = timed_generate(model, ids, 1)
            result["prefill"] = {"tokens": args.prefill_tokens, "ttft_s": ttft,
                                 "tokens_per_s": args.prefill_tokens / ttft}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
