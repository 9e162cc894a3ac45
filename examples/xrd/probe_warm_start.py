#!/usr/bin/env python3
"""Feasibility probe of the xrd warm start: does a tiny random Qwen3-MoE learn the format and the
copying from warm.jsonl, quickly on a CPU, and then sample about the demonstrator's reward?

    probe_warm_start.py --build BUILD --work DIR [--steps N --lr X --batch-size N ...]

1. make_data.py's files into DIR/data (--warm traces);
2. a random Qwen3-MoE checkpoint into DIR/init (written here, numpy only, in the layout of
   src/engine/testing/tiny_model.cc, whose write_tiny_model has no --hidden/--experts/--std);
3. `bragg-train --objective sft` on warm.jsonl into DIR/sft (timed; --metrics DIR/metrics.jsonl);
4. `bragg-engine --model DIR/sft --listen 127.0.0.1:0`, then multi-turn rollouts through
   POST /generate, each with its own tool_server.py process, scored by verifier.py: sampled
   (temperature 1) and greedy (temperature 0).
Prints one JSON summary line (and writes it to DIR/summary.json).
"""

import argparse
import concurrent.futures as cf
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SANDBOX = os.path.join(HERE, "sandbox")
sys.path.insert(0, HERE)

import make_data  # noqa: E402

STOP = 2  # "\n"


def write_model(out, vocab, hidden, layers, experts, top_k, moe_intermediate, heads, kv_heads,
                head_dim, std, seed):
    """A random Qwen3MoeForCausalLM checkpoint: F32, N(0, std) weights, norms at 1."""
    os.makedirs(out, exist_ok=True)
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 4 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": 512,
              "tie_word_embeddings": False, "torch_dtype": "float32", "num_experts": experts,
              "num_experts_per_tok": top_k, "moe_intermediate_size": moe_intermediate,
              "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "eos_token_id": STOP}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden],
              "lm_head.weight": [vocab, hidden]}
    for i in range(layers):
        p = "model.layers.%d." % i
        shapes[p + "input_layernorm.weight"] = [hidden]
        shapes[p + "post_attention_layernorm.weight"] = [hidden]
        shapes[p + "self_attn.q_proj.weight"] = [heads * head_dim, hidden]
        shapes[p + "self_attn.k_proj.weight"] = [kv_heads * head_dim, hidden]
        shapes[p + "self_attn.v_proj.weight"] = [kv_heads * head_dim, hidden]
        shapes[p + "self_attn.o_proj.weight"] = [hidden, heads * head_dim]
        shapes[p + "self_attn.q_norm.weight"] = [head_dim]
        shapes[p + "self_attn.k_norm.weight"] = [head_dim]
        shapes[p + "mlp.gate.weight"] = [experts, hidden]
        for e in range(experts):
            q = "%smlp.experts.%d." % (p, e)
            shapes[q + "gate_proj.weight"] = [moe_intermediate, hidden]
            shapes[q + "up_proj.weight"] = [moe_intermediate, hidden]
            shapes[q + "down_proj.weight"] = [hidden, moe_intermediate]
    rng = np.random.default_rng(seed)
    header, blobs, offset = {}, [], 0
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            w = np.ones(shape, dtype=np.float32)
        else:
            w = rng.normal(0.0, std, size=shape).astype(np.float32)
        b = w.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)
    return sum(int(np.prod(s)) for s in shapes.values())


class Engine:
    def __init__(self, binary, model, threads, log):
        self.proc = subprocess.Popen([binary, "--model", model, "--listen", "127.0.0.1:0",
                                      "--threads", str(threads)],
                                     stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (\S+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError("bragg-engine did not start: %r" % line)
        self.url = m.group(1).rstrip("/")
        if not self.url.startswith("http"):
            self.url = "http://" + self.url

    def generate(self, ids, temperature, max_new_tokens, seed=None):
        params = {"temperature": temperature, "max_new_tokens": max_new_tokens,
                  "stop_token_ids": [STOP]}
        body = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def rollout(engine, vocab, pair, temperature, max_new_tokens, max_turns):
    """One multi-turn rollout with its own tool server; a dict of what happened."""
    server = subprocess.Popen([sys.executable, os.path.join(SANDBOX, "tool_server.py")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    prompt = pair["prompt"]
    ids = vocab.encode(prompt)
    turns, observations, stops, errors, finish = [], [], [], 0, []
    try:
        for _ in range(max_turns):
            out = engine.generate(ids, temperature, max_new_tokens)
            out_ids = out["output_ids"]
            finish.append((out["meta_info"].get("finish_reason") or {}).get("type"))
            stops.append(bool(out_ids) and out_ids[-1] == STOP)
            if finish[-1] == "stop" and not stops[-1]:
                # The engine left the matched stop token out: the model did emit it.
                out_ids = out_ids + [STOP]
            ids = ids + out_ids
            turn = vocab.decode(out_ids)
            turns.append(turn)
            server.stdin.write(json.dumps({"text": turn}) + "\n")
            server.stdin.flush()
            reply = json.loads(server.stdout.readline())
            if reply.get("done"):
                break
            errors += bool(reply.get("error"))
            observations.append(reply["observation"])
            ids = ids + vocab.encode(reply["observation"])
    finally:
        server.stdin.close()
        server.wait(timeout=10)
    record = {"prompt": prompt, "meta": pair["meta"], "turns": turns,
              "observations": observations}
    v = subprocess.run([sys.executable, os.path.join(SANDBOX, "verifier.py")],
                       input=json.dumps(record), capture_output=True, text=True, timeout=30)
    reward = int(v.stdout.strip())
    m = pair["meta"]
    want = re.compile(r"lattice %s\n" % m["element"]), \
        re.compile(r"bragg (\S+) (100|110|111) %s\n" % m["tube"]), re.compile(r"answer (\S+)\n")
    well_formed = (len(turns) == 3 and errors == 0 and len(observations) == 2 and
                   all(w.fullmatch(t) for w, t in zip(want, turns)))
    hkl = None
    copied = False
    if well_formed:
        a_obs = observations[0].split()[1]
        a_used, hkl = want[1].fullmatch(turns[1]).groups()
        copied = a_used == a_obs and want[2].fullmatch(turns[2]).group(1) == observations[1][:-1]
    return {"reward": reward, "well_formed": well_formed, "copied": copied, "hkl": hkl,
            "structure": m["structure"], "stops": stops, "finish": finish, "turns": turns,
            "observations": observations, "prompt": prompt}


def evaluate(engine, vocab, pairs, temperature, args):
    with cf.ThreadPoolExecutor(args.concurrency) as ex:
        results = list(ex.map(lambda p: rollout(engine, vocab, p, temperature,
                                                args.max_new_tokens, args.max_turns), pairs))
    n = len(results)
    by_structure = {}
    for r in results:
        if r["hkl"]:
            s = by_structure.setdefault(r["structure"], {})
            s[r["hkl"]] = s.get(r["hkl"], 0) + 1
    turns_with_stop = [s for r in results for s in r["stops"]]
    finishes = {}
    for r in results:
        for f in r["finish"]:
            finishes[str(f)] = finishes.get(str(f), 0) + 1
    return {"rollouts": n, "reward": sum(r["reward"] for r in results) / n,
            "well_formed": sum(r["well_formed"] for r in results) / n,
            "copied": sum(r["copied"] for r in results) / n,
            "output_ids_end_in_stop": sum(turns_with_stop) / max(1, len(turns_with_stop)),
            "finish_reasons": finishes, "hkl_by_structure": by_structure,
            "examples": [r["prompt"] + "".join(t + o for t, o in zip(r["turns"],
                                                                     r["observations"] + [""]))
                         for r in results[:3]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", required=True, help="build dir with src/train/bragg-train and "
                    "src/engine/bragg-engine")
    ap.add_argument("--work", required=True, help="scratch directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--moe-intermediate", type=int, default=64)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rollouts", type=int, default=100)
    ap.add_argument("--heldout", action="store_true", help="roll out held-out pairs, not train")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--max-turns", type=int, default=4)
    ap.add_argument("--skip-train", action="store_true", help="reuse DIR/sft")
    args = ap.parse_args()

    train_bin = os.path.join(args.build, "src/train/bragg-train")
    engine_bin = os.path.join(args.build, "src/engine/bragg-engine")
    data = os.path.join(args.work, "data")
    init, sft = os.path.join(args.work, "init"), os.path.join(args.work, "sft")
    vocab = make_data.Vocab()
    summary = {"args": vars(args)}
    if not args.skip_train:
        make_data.make(data, args.seed, args.warm)
        summary["parameters"] = write_model(
            init, len(vocab.tokens), args.hidden, args.layers, args.experts, args.top_k,
            args.moe_intermediate, heads=4, kv_heads=2, head_dim=args.hidden // 4, std=args.std,
            seed=args.seed)
        metrics = os.path.join(args.work, "metrics.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        cmd = [train_bin, "--model", init, "--trajectories", os.path.join(data, "warm.jsonl"),
               "--out", sft, "--objective", "sft", "--steps", str(args.steps), "--batch-size",
               str(args.batch_size), "--lr", str(args.lr), "--threads", str(args.threads),
               "--metrics", metrics]
        summary["train_command"] = " ".join(cmd)
        t0 = time.monotonic()
        with open(os.path.join(args.work, "train.log"), "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=log)
        summary["train_seconds"] = round(time.monotonic() - t0, 1)
        with open(metrics) as f:
            losses = [json.loads(line)["loss"] for line in f]
        summary["loss_first_last"] = [losses[0], sum(losses[-10:]) / len(losses[-10:])]

    pairs = make_data.read_jsonl(os.path.join(data, "heldout.jsonl" if args.heldout
                                              else "prompts.jsonl"))
    rng = random.Random(args.seed + 1)
    sampled_pairs = [rng.choice(pairs) for _ in range(args.rollouts)]
    with open(os.path.join(args.work, "engine.log"), "w") as log:
        engine = Engine(engine_bin, sft, args.threads, log)
        try:
            t0 = time.monotonic()
            summary["sampled"] = evaluate(engine, vocab, sampled_pairs, 1.0, args)
            summary["greedy"] = evaluate(engine, vocab, pairs, 0.0, args)
            summary["rollout_seconds"] = round(time.monotonic() - t0, 1)
        finally:
            engine.close()
    with open(os.path.join(args.work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
