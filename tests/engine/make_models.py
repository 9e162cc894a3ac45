"""Tiny random Qwen3 checkpoints and what Hugging Face transformers computes on them: the
reference side of bragg-engine's parity test (test_transformers_parity.py).

    make_models.py OUT_DIR [--only NAME ...]

For every shape in SHAPES it writes OUT_DIR/NAME/ (config.json + model.safetensors through
save_pretrained, as a trainer would) and OUT_DIR/NAME/reference/:
  ids_L<n>.json, logits_L<n>.npy   fixed token sequences of lengths 1, 7, 64, 300 and
                                   transformers' full-sequence logits, float32 [n, vocab]
  greedy.json                      prompts, transformers' greedy output ids (generate(),
                                   do_sample=False, no EOS), per-step logprob of the chosen
                                   token and top-2 logit gap, and the smallest gap
  logits_exact_L<n>.npy            the same weights computed in a wider type (float64 for a
                                   float32 checkpoint, float32 for bfloat16): the yardstick of
                                   rounding error, transformers' and the engine's alike
For the bfloat16 checkpoint the logits are transformers' in bfloat16.

Weights are random with fixed seeds and scaled so that logits spread widely (std ~4): greedy
decoding then has no near-ties for the engine's rounding to flip. Prompts for the greedy check
are drawn until every step's top-2 gap is at least MIN_GAP (fp32) — a prompt is a fixed
function of the seed, so the files are the same on every run on one machine.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
import transformers

SEQ_LENGTHS = (1, 7, 64, 300)
GREEDY_TOKENS = 256
GREEDY_TOKENS_BF16 = 32
GREEDY_PROMPT_LENGTHS = (5, 40)
LOGIT_STD = 4.0
MIN_GAP = {"float32": 2e-3, "bfloat16": 0.0}  # bf16: recorded, not chosen for (see the test)

_COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, head_dim=32,
               max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
               bos_token_id=None, eos_token_id=None, pad_token_id=None)

# name -> (architecture, config overrides, seed, dtype)
SHAPES = {
    "dense": ("Qwen3ForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                   tie_word_embeddings=False), 1, "float32"),
    "moe": ("Qwen3MoeForCausalLM",
            dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 tie_word_embeddings=False), 2, "float32"),
    # layer 0 a dense MLP (intermediate_size), layers 1-3 routed
    "moe_dense_first": ("Qwen3MoeForCausalLM",
                        dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                             tie_word_embeddings=False), 3, "float32"),
    "gqa4_tied": ("Qwen3ForCausalLM",
                  dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=256,
                       tie_word_embeddings=True), 4, "float32"),
    "dense_bf16": ("Qwen3ForCausalLM",
                   dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                        tie_word_embeddings=False), 5, "bfloat16"),
}


def build(arch, overrides, seed):
    torch.manual_seed(seed)
    if arch == "Qwen3ForCausalLM":
        config = transformers.Qwen3Config(**_COMMON, **overrides, initializer_range=0.2)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(**_COMMON, **overrides, initializer_range=0.2)
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        # Norm weights start at 1: randomise them, so a norm loaded from the wrong tensor (or
        # not at all) changes the output.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        # Wide logits (no near-ties), by scaling the output projection (with tied embeddings the
        # embedding too, which the first norm makes harmless to the rest of the network).
        probe = torch.randint(0, config.vocab_size, (1, 64))
        std = model(probe).logits.float().std().item()
        model.lm_head.weight.mul_(LOGIT_STD / std)
    model.eval()
    return model


def top2_gap(logits):
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[..., 0] - top[..., 1])


def greedy(model, prompt, n):
    """transformers' greedy decoding of n tokens, never stopped early; per-step logits."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                         temperature=None, top_p=None, top_k=None)
    output_ids = out.sequences[0, len(prompt):].tolist()
    assert len(output_ids) == n, f"generate() stopped after {len(output_ids)} of {n} tokens"
    steps = torch.stack([l[0] for l in out.logits]).float()  # [n, vocab]
    logprobs = torch.log_softmax(steps, dim=-1)
    chosen = logprobs[torch.arange(n), torch.tensor(output_ids)]
    return output_ids, chosen.tolist(), top2_gap(steps).tolist()


def make(name, out_dir):
    arch, overrides, seed, dtype = SHAPES[name]
    model = build(arch, overrides, seed)
    vocab = model.config.vocab_size
    model_dir = os.path.join(out_dir, name)
    ref_dir = os.path.join(model_dir, "reference")
    os.makedirs(ref_dir, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    model = model.to(torch_dtype)
    model.config.dtype = torch_dtype
    model.generation_config.eos_token_id = None
    model.save_pretrained(model_dir, safe_serialization=True)
    # The reference runs on the checkpoint as saved (what the engine loads), not the object.
    model = type(model).from_pretrained(model_dir, dtype=torch_dtype).eval()
    # Two float32 programs differ by their rounding (~1e-4 on these logits, transformers' own
    # distance from float64): the parity test compares both against the wider computation.
    exact = type(model).from_pretrained(
        model_dir, dtype=torch.float64 if dtype == "float32" else torch.float32).eval()

    rng = np.random.default_rng(1000 + seed)
    with torch.no_grad():
        for n in SEQ_LENGTHS:
            ids = rng.integers(0, vocab, n).tolist()
            with open(os.path.join(ref_dir, f"ids_L{n}.json"), "w") as f:
                json.dump(ids, f)
            t = torch.tensor([ids])
            logits = model(t).logits[0].float().numpy()
            np.save(os.path.join(ref_dir, f"logits_L{n}.npy"), logits)
            np.save(os.path.join(ref_dir, f"logits_exact_L{n}.npy"), exact(t).logits[0].numpy())

        n_new = GREEDY_TOKENS if dtype == "float32" else GREEDY_TOKENS_BF16
        runs = []
        for length in GREEDY_PROMPT_LENGTHS:
            for attempt in range(100):
                prompt = rng.integers(0, vocab, length).tolist()
                output_ids, logprobs, gaps = greedy(model, prompt, n_new)
                if min(gaps) >= MIN_GAP[dtype]:
                    break
            else:
                sys.exit(f"{name}: no prompt of length {length} without a near-tie in 100 tries")
            runs.append(dict(prompt=prompt, output_ids=output_ids, logprobs=logprobs, gaps=gaps,
                             min_gap=min(gaps), attempts=attempt + 1))
    info = dict(name=name, architecture=arch, dtype=dtype, vocab=vocab, seed=seed,
                seq_lengths=list(SEQ_LENGTHS), greedy=runs,
                transformers=transformers.__version__, torch=torch.__version__)
    with open(os.path.join(ref_dir, "greedy.json"), "w") as f:
        json.dump(info, f)
    return model_dir


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--only", nargs="*", choices=sorted(SHAPES), help="default: every shape")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    for name in args.only or SHAPES:
        print(make(name, args.out_dir), flush=True)


if __name__ == "__main__":
    main()
