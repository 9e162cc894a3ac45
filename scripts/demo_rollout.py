"""make demo, part 2: one RL rollout step through every part of Bragg, on this machine.

- the "trainer" publishes two checkpoints of a tiny Qwen3-MoE (4 layers, 4 experts, top-2; real
  weights, two seeds): each a Megatron torch_dist checkpoint written by 4 gloo ranks (Debian's
  torch, tests/reshard/megatron_fixture.py), converted to Hugging Face safetensors by
  bragg-reshard (--verify). Step 0 is what the fleet starts on; step 1 is the update;
- 2 real inference servers (bragg-engine, libtorch on the CPU, one compute thread each, greedy
  decoding on batch-invariant kernels so a run's tokens do not depend on its batching, a
  token-granular prefix cache as SGLang's default page size 1) load step 0, behind
  bragg-gateway with the sticky policy;
- 24 multi-turn rollouts sharing one system prompt, each with its own pbox sandbox in which its
  tool calls run (Python on the model's output; every result checked against the same
  computation here, and its text mapped into the model's 50-token vocabulary for the next turn),
  each turn asking only for the new suffix of its routed experts (the model's real router);
- once a third of the turns are done the whole fleet loads step 1 in place (POST
  /weights/update) while the rollouts keep running;
- then the finished trajectories are packed for training with bragg_pack (THD rows balanced
  over 2 data-parallel ranks, context parallel 2), tokens and routed experts round-tripped
  through the packed layout.

Checks (the demo fails if any does not hold): every turn after the first reuses the cache of
all the rollout's earlier tokens (stickiness), every output token is covered by a weight-version
span, some turns ran on each version, the assembled routed experts equal a full request's,
every tool result is right, every sandbox is gone at the end, the packed layout restores every
trajectory exactly, and the two versions generate differently for the same prompt (greedy: the
update changed the model, not just its version name).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
# A real model on 2 shared cores: 2 workers with one compute thread each (a decode step of the
# tiny model is a few ms of libtorch overhead, so one thread per worker is its fastest setting).
ROLLOUTS = 24
TURNS = 4
WORKERS = 2
SYSTEM_TOKENS = 512
MAX_NEW_TOKENS = (12, 32)  # per turn, drawn per rollout and turn
# The trainer's two steps: the weights' seed in the Megatron fixture (1234 is its default).
STEP_SEEDS = {0: 1234, 1: 1235}
PROBE = {"max_new_tokens": 16, "temperature": 0.0}

# The tool: statistics of the model's last output, as a scientific tool would summarise data.
TOOL = ("import sys, statistics as s; x = [int(a) for a in sys.argv[1:]]; "
        "print(f'n={len(x)} mean={s.fmean(x):.3f} stdev={s.pstdev(x):.3f} max={max(x)}')")


def tool_here(ids: List[int]) -> str:
    import statistics as s
    return f"n={len(ids)} mean={s.fmean(ids):.3f} stdev={s.pstdev(ids):.3f} max={max(ids)}"


def text_tokens(text: str, vocab: int) -> List[int]:
    """The tool's text as token ids the model accepts: one token per character, its code point
    folded into the vocabulary (the tiny model has no tokenizer)."""
    return [ord(c) % vocab for c in text]


def start_all(argvs: List[List[str]], log) -> List[tuple]:
    """Starts servers that print `listening on URL` first (all at once: each loads for a few
    seconds); returns [(process, URL)]."""
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=log, text=True) for a in argvs]
    out, bad = [], None
    for a, p in zip(argvs, procs):
        line = p.stdout.readline()
        if not line.startswith("listening on "):
            bad = bad or f"{Path(a[0]).name} did not start: {line!r} (see rollout-step.log)"
        out.append((p, line.split()[-1] if line else ""))
    if bad:
        for p in procs:
            p.kill()
            p.wait()
        raise RuntimeError(bad)
    return out


def post(url: str, body: Dict, timeout: float = 300) -> tuple:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def metric(text: str, name: str) -> Dict[str, float]:
    """Samples of one Prometheus metric: {label text: value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


def parameter_count(model_dir: Path) -> int:
    """Elements of every tensor in the directory's safetensors shards (read from their headers)."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        with open(model_dir / shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                count = 1
                for d in t["shape"]:
                    count *= d
                total += count
    return total


def publish_steps(build: Path, work: Path, log) -> Dict[int, Path]:
    """The trainer's steps 0 and 1: Megatron checkpoints of the same model with different
    weights (the fixture's seed), each converted to Hugging Face safetensors by bragg-reshard.
    Returns {step: directory}."""
    fixtures = {}
    for step, seed in STEP_SEEDS.items():
        fixtures[step] = subprocess.Popen(
            ["/usr/bin/python3", str(ROOT / "tests/reshard/megatron_fixture.py"), "all",
             "--root", str(work / f"megatron-{step}"), "--families", "qwen3_moe", "--seed",
             str(seed)], stdout=log, stderr=log)
    for step, p in fixtures.items():
        if p.wait(timeout=300) != 0:
            raise RuntimeError(f"the Megatron fixture of step {step} failed (see rollout-step.log)")
    out = {}
    for step in STEP_SEEDS:
        src = work / f"megatron-{step}"
        out[step] = work / f"hf-step-{step}"
        subprocess.run([str(build / "src/reshard/bragg-reshard"), "convert",
                        "--src", str(src / "qwen3_moe"), "--dst", str(out[step]),
                        "--model", "qwen3_moe", "--hf-config-dir",
                        str(src / "qwen3_moe-hf-config"), "--threads", "2", "--verify"],
                       check=True, stdout=log, stderr=log, timeout=300)
        index = json.loads((out[step] / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        print(f"  trainer: step {step} (seed {STEP_SEEDS[step]}) written by 4 Megatron ranks, "
              f"converted by bragg-reshard: {len(index['weight_map'])} tensors in "
              f"{len(shards)} safetensors shard(s), verified against the Megatron chunks",
              flush=True)
    return out


def run_rollout_step(build: Path, pbox, endpoint: str, root: Path) -> bool:
    import numpy as np

    sys.path.insert(0, str(build / "python"))
    import bragg_gateway as bgc
    import bragg_pack as bp

    errors: List[str] = []
    procs = []
    log = open(root / "rollout-step.log", "wb")
    t_step = time.monotonic()
    try:
        # The trainer's checkpoints exist before the fleet starts: step 0 is what it serves,
        # step 1 what it loads once a third of the turns are done (the update lands mid-step).
        steps = publish_steps(build, root / "trainer", log)
        config = json.loads((steps[0] / "config.json").read_text())
        params = parameter_count(steps[0])
        if parameter_count(steps[1]) != params:
            raise RuntimeError("steps 0 and 1 have different parameter counts")

        started = start_all([[str(build / "src/engine/bragg-engine"), "--model", str(steps[0]),
                              "--listen", "127.0.0.1:0", "--threads", "1", "--weight-version",
                              "0", "--block-size", "1", "--kv-cache-tokens", "65536",
                              "--deterministic"] for _ in range(WORKERS)], log)
        procs += [p for p, _ in started]
        urls = [u for _, u in started]
        argv = [str(build / "src/gateway/bragg-gateway"), "--listen", "127.0.0.1:0",
                "--policy", "sticky"]
        for u in urls:
            argv += ["--worker", u]
        [(p, gw)] = start_all([argv], log)
        procs.append(p)

        # The model's shape as the server loaded it, held against the checkpoint's config.json.
        info = json.loads(get(urls[0] + "/get_model_info"))
        vocab = int(info["vocab_size"])
        moe_layers, moe_topk = len(info["moe_layers"]), int(info["experts_per_token"])
        if (vocab, moe_topk, info["num_experts"]) != (config["vocab_size"],
                                                      config["num_experts_per_tok"],
                                                      config["num_experts"]):
            raise RuntimeError(f"the engine reports {info}, the checkpoint's config.json "
                               f"{config}")
        print(f"model: {info['architectures'][0]} from the trainer's checkpoints, "
              f"{params:,} parameters ({info['dtype']}): {info['num_layers']} layers, hidden "
              f"{config['hidden_size']}, {info['num_experts']} experts top-{moe_topk} on "
              f"{moe_layers} MoE layers, vocabulary {vocab}; weight versions 0 "
              f"({steps[0].name}) and 1 ({steps[1].name})", flush=True)
        print(f"gateway {gw} (sticky) in front of {WORKERS} bragg-engine workers (CPU, 1 "
              f"compute thread each, greedy); {ROLLOUTS} rollouts x {TURNS} turns of "
              f"{MAX_NEW_TOKENS[0]}-{MAX_NEW_TOKENS[1]} new tokens, a pbox sandbox each for "
              "their tool calls", flush=True)

        system_prompt = [random.Random(1).randrange(vocab) for _ in range(SYSTEM_TOKENS)]
        probe = system_prompt[:64]
        # Its own cache salt per version, so each probe computes the whole prompt on its weights.
        status, before = post(gw + "/generate", {"input_ids": probe, "sampling_params": PROBE,
                                                 "extra_key": "probe-0"})
        if status != 200:
            raise RuntimeError(f"probe on version 0: HTTP {status} {before}")

        total_turns = ROLLOUTS * TURNS
        turns_done = [0]
        lock = threading.Lock()
        update: Dict = {}
        ready_to_update = threading.Event()  # a third of the turns are done

        def trainer() -> None:
            try:
                ready_to_update.wait(timeout=600)
                t0 = time.monotonic()
                status, report = post(gw + "/weights/update",
                                      {"model_path": str(steps[1]), "weight_version": "1"})
                update.update(status=status, report=report, ms=(time.monotonic() - t0) * 1e3)
                with lock:
                    at = turns_done[0]
                print(f"  fleet weight update to version 1 ({steps[1].name}): HTTP {status} in "
                      f"{update['ms']:.0f} ms, at {at} of {total_turns} turns", flush=True)
            except Exception as e:  # noqa: BLE001 - reported below
                update.update(status=0, error=f"{type(e).__name__}: {e}")

        results: Dict[int, Dict] = {}
        t_start = time.monotonic()

        def rollout(session, r: int) -> None:
            rng = random.Random(100 + r)
            rid = f"rollout-{r}"
            client = bgc.RolloutClient(gw, return_routed_experts=True)
            sb = session.create(memory="256M", disk="64M", labels={"rollout": str(r)})
            ctx = system_prompt + [rng.randrange(vocab) for _ in range(rng.randint(32, 128))]
            turns = []
            try:
                for t in range(TURNS):
                    t_gen = time.monotonic()
                    res = client.generate(rid, ctx, {"max_new_tokens":
                                                     rng.randint(*MAX_NEW_TOKENS),
                                                     "temperature": 0.0})
                    out, meta = res["output_ids"], res["meta_info"]
                    turns.append({"prompt": len(ctx), "out": len(out),
                                  "cached": meta["cached_tokens"],
                                  "version": meta["weight_version"],
                                  "spans": meta.get("weight_versions", [])})
                    turns[-1]["gen_ms"] = (time.monotonic() - t_gen) * 1e3
                    t_tool = time.monotonic()
                    run = sb.run(["/usr/bin/python3", "-c", TOOL] + [str(x) for x in out],
                                 timeout=60)
                    tool_ms = (time.monotonic() - t_tool) * 1e3
                    text = run.stdout.decode() if isinstance(run.stdout, bytes) else run.stdout
                    if not run.ok or text.strip() != tool_here(out):
                        raise AssertionError(f"{rid} turn {t}: tool gave {text!r}, "
                                             f"expected {tool_here(out)!r}")
                    turns[-1]["tool_ms"] = tool_ms
                    ctx = ctx + out + text_tokens(text.strip(), vocab)
                    with lock:
                        turns_done[0] += 1
                        done = turns_done[0]
                        if done >= total_turns // 3:
                            ready_to_update.set()
                    if done % 16 == 0 or done == total_turns:
                        print(f"  {done:3d}/{total_turns} turns done "
                              f"({time.monotonic() - t_start:.0f} s)", flush=True)
                held = list(client.routed_experts(rid))
                # A full request on the same rollout (so on the same worker): its array must
                # begin with the one assembled from the per-turn suffixes.
                full = bgc.RolloutClient(gw, return_routed_experts=True, delta=False)
                full.generate(rid, ctx, {"max_new_tokens": 1, "temperature": 0.0})
                whole = list(full.routed_experts(rid))
                # One row of experts per context token (the full request's prompt is ctx).
                experts = np.asarray(whole, dtype=np.int32).reshape(-1, moe_layers, moe_topk)
                results[r] = {"turns": turns, "tokens": len(ctx),
                              "experts_equal": whole[:len(held)] == held and len(held) > 0,
                              "experts": experts[:len(ctx)],
                              "ids": np.asarray(ctx, dtype=np.int32)}
                client.forget(rid)
            finally:
                sb.destroy(missing_ok=True)

        train = threading.Thread(target=trainer)
        train.start()
        client = pbox.Client(endpoint)
        with client.session(client_name="make-demo-rollouts") as session:
            finished = 0
            with cf.ThreadPoolExecutor(max_workers=12) as pool:
                futures = {pool.submit(rollout, session, r): r for r in range(ROLLOUTS)}
                for fut in cf.as_completed(futures):
                    try:
                        fut.result()
                    except Exception as e:  # noqa: BLE001 - reported below
                        errors.append(f"rollout {futures[fut]}: {type(e).__name__}: {e}")
                    finished += 1
                    if finished % 6 == 0 or finished == ROLLOUTS:
                        print(f"  {finished:2d}/{ROLLOUTS} rollouts finished", flush=True)
            if session.list():
                errors.append(f"{len(session.list())} sandboxes still live after the rollouts")
        ready_to_update.set()
        train.join()
        client.close()
        elapsed = time.monotonic() - t_start

        # The checks.
        if update.get("status") != 200:
            errors.append(f"fleet weight update failed: {update}")
        prompt = cached = spanning = out_tokens = 0
        versions: Dict[str, int] = {}
        gen_ms: List[float] = []
        tool_ms: List[float] = []
        experts_equal = 0
        for r, res in sorted(results.items()):
            if res["experts_equal"]:
                experts_equal += 1
            else:
                errors.append(f"rollout {r}: delta routed experts differ from the full array")
            prev_total = 0
            for t, turn in enumerate(res["turns"]):
                prompt += turn["prompt"]
                cached += turn["cached"]
                out_tokens += turn["out"]
                versions[turn["version"]] = versions.get(turn["version"], 0) + 1
                # Sticky: all the rollout's earlier tokens (prompt + output but the last output
                # token, whose KV no step computed) are cached on its worker.
                if t > 0 and turn["cached"] < prev_total - 1:
                    errors.append(f"rollout {r} turn {t}: {turn['cached']} cached tokens, "
                                  f"{prev_total - 1} expected on its worker")
                prev_total = turn["prompt"] + turn["out"]
                gen_ms.append(turn["gen_ms"] / max(1, turn["out"]))
                tool_ms.append(turn["tool_ms"])
                spans = turn["spans"]
                spanning += len({sp["version"] for sp in spans}) > 1
                covered = (spans and spans[0]["start"] == 0 and spans[-1]["end"] == turn["out"]
                           and all(a["end"] == b["start"] for a, b in zip(spans, spans[1:])))
                if not covered:
                    errors.append(f"rollout {r} turn {t}: weight-version spans {spans} do not "
                                  f"cover its {turn['out']} output tokens")
        if len(versions) < 2:
            errors.append(f"every turn ran on one weight version ({versions}): the update did "
                          "not land during the rollouts")
        metrics = get(gw + "/metrics")
        load = metric(metrics, "bragg_gateway_worker_requests_total")
        hit = cached / prompt if prompt else 0.0
        n_turns = sum(len(x["turns"]) for x in results.values())
        print(f"rollouts: {len(results)}/{ROLLOUTS} ({n_turns} turns, {out_tokens} generated "
              f"tokens) in {elapsed:.1f} s; token-weighted cache "
              f"hit rate {hit:.3f} ({cached} of {prompt} prompt tokens cached; the "
              f"{SYSTEM_TOKENS}-token system prompt shared by all); turns per weight version "
              f"{dict(sorted(versions.items()))}", flush=True)
        if load:
            print(f"requests per worker: {sorted(int(v) for v in load.values())}", flush=True)
        if gen_ms:
            gen_ms.sort()
            tool_ms.sort()
            print(f"per turn p50: generate {gen_ms[len(gen_ms) // 2]:.1f} ms per new token "
                  f"(12 rollouts in flight on {WORKERS} single-threaded workers), tool call in "
                  f"its sandbox {tool_ms[len(tool_ms) // 2]:.0f} ms; {spanning} turn(s) "
                  "generated across the weight update (output spans on both versions)",
                  flush=True)
        print(f"routed experts (the model's router, {moe_layers} layers x top-{moe_topk}): "
              f"{experts_equal}/{len(results)} rollouts' per-turn deltas equal a full request's",
              flush=True)

        # The update is real: the same greedy prompt generates differently on step 1's weights.
        status, after = post(gw + "/generate", {"input_ids": probe, "sampling_params": PROBE,
                                                "extra_key": "probe-1"})
        if status != 200:
            errors.append(f"probe on version 1: HTTP {status} {after}")
        else:
            v0 = (before["meta_info"]["weight_version"], before["output_ids"])
            v1 = (after["meta_info"]["weight_version"], after["output_ids"])
            print(f"greedy on one prompt: version {v0[0]} -> {v0[1]}, version {v1[0]} -> "
                  f"{v1[1]}", flush=True)
            if (v0[0] != "0" or v1[0] != "1" or v0[1] == v1[1]
                    or after["meta_info"]["cached_tokens"] != 0):
                errors.append(f"versions 0 and 1 must generate differently: {v0} vs {v1}")

        # Packing for the trainer: 2 data-parallel ranks, context parallel 2.
        if results:
            rs = [results[r] for r in sorted(results)]
            lengths = np.asarray([x["tokens"] for x in rs], dtype=np.int64)
            plan = bp.plan(lengths, dp=2, max_tokens=4096, cp=2)
            s = plan.summary
            print(f"packed {len(rs)} trajectories ({int(lengths.sum())} tokens) into "
                  f"{plan.micro_batches_per_rank} micro-batch(es) per rank on 2 DP ranks, CP 2: "
                  f"max/mean cost {s['max_over_mean']:.3f}, padding "
                  f"{100 * s['padding_fraction']:.2f}%", flush=True)
            restored = 0
            for dp_rank in range(2):
                for step in range(plan.micro_batches_per_rank):
                    mb = plan.micro_batch(dp_rank, step)
                    for row in mb.get("rows", [mb]):
                        cu, cup = row["cu_seqlens"], row["cu_seqlens_padded"]
                        members = [rs[int(i)] for i in row["trace_ids"]]
                        if not members:
                            continue
                        for key, fill in (("ids", 0), ("experts", -1)):
                            want = np.concatenate([m[key] for m in members])
                            packed = bp.pack_to_padded(want, cu, cup, fill=fill)
                            # CP 2: each rank's zigzag half, put back together.
                            parts = [bp.partition(packed, bp.cp_indices(cup, 2, c))
                                     for c in range(2)]
                            whole = bp.restore(parts, [bp.cp_indices(cup, 2, c)
                                                       for c in range(2)], len(packed))
                            back = bp.unpack_from_padded(whole, cu, cup)
                            if not np.array_equal(back, want):
                                errors.append(f"rank {dp_rank} step {step}: packed {key} do "
                                              "not restore")
                        restored += len(members)
            if restored != len(rs):
                errors.append(f"the plan holds {restored} trajectories, not {len(rs)}")
        print(f"rollout step: {time.monotonic() - t_step:.1f} s in all (checkpoints, fleet "
              "start, rollouts, checks, packing)", flush=True)
    except Exception as e:  # noqa: BLE001 - reported below
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        log.close()
    for e in errors[:10]:
        print(f"demo: {e}", file=sys.stderr, flush=True)
    if len(errors) > 10:
        print(f"demo: ... and {len(errors) - 10} more", file=sys.stderr, flush=True)
    if not errors:
        shutil.rmtree(root / "trainer", ignore_errors=True)
    return not errors
