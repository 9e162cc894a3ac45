"""make demo, part 2: one RL rollout step through every part of Bragg, on this machine.

- 4 simulated SGLang workers (bragg-sim-worker: prefix cache, weight versions, routed experts of
  a small MoE) behind bragg-gateway with the sticky policy;
- 24 multi-turn rollouts sharing one system prompt, each with its own pbox sandbox in which its
  tool calls run (Python on the model's output; every result checked against the same
  computation here), each turn asking only for the new suffix of its routed experts;
- the "trainer" publishes step 1: a Megatron torch_dist checkpoint of a tiny Qwen3-MoE written
  by 4 gloo ranks (Debian's torch, tests/reshard/megatron_fixture.py), converted to Hugging
  Face safetensors by bragg-reshard (--verify); once a third of the turns are done the whole
  fleet loads it in place (POST /weights/update) while the rollouts keep running;
- then the finished trajectories are packed for training with bragg_pack (THD rows balanced
  over 2 data-parallel ranks, context parallel 2), tokens and routed experts round-tripped
  through the packed layout.

Checks (the demo fails if any does not hold): every turn after the first reuses the cache of
all the rollout's earlier tokens (stickiness), every output token is covered by a weight-version
span, some turns ran on each version, the assembled routed experts equal a full request's,
every tool result is right, every sandbox is gone at the end, and the packed layout restores
every trajectory exactly.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
ROLLOUTS = 24
TURNS = 4
WORKERS = 4
MOE_LAYERS, MOE_TOPK = 4, 2
SYSTEM_PROMPT = [random.Random(1).randrange(32000) for _ in range(512)]

# The tool: statistics of the model's last output, as a scientific tool would summarise data.
TOOL = ("import sys, statistics as s; x = [int(a) for a in sys.argv[1:]]; "
        "print(f'n={len(x)} mean={s.fmean(x):.3f} stdev={s.pstdev(x):.3f} max={max(x)}')")


def tool_here(ids: List[int]) -> str:
    import statistics as s
    return f"n={len(ids)} mean={s.fmean(ids):.3f} stdev={s.pstdev(ids):.3f} max={max(ids)}"


def start(argv: List[str], log) -> tuple:
    """Starts a server that prints `listening on URL` first; returns (process, URL)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        p.kill()
        p.wait()
        raise RuntimeError(f"{Path(argv[0]).name} did not start: {line!r}")
    return p, line.split()[-1]


def post(url: str, body: Dict, timeout: float = 120) -> tuple:
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


def publish_step(build: Path, work: Path, log) -> Path:
    """The trainer's step 1: a Megatron checkpoint, converted to Hugging Face safetensors."""
    subprocess.run(["/usr/bin/python3", str(ROOT / "tests/reshard/megatron_fixture.py"), "all",
                    "--root", str(work), "--families", "qwen3_moe"], check=True, stdout=log,
                   stderr=log, timeout=300)
    out = work / "hf-step-1"
    subprocess.run([str(build / "src/reshard/bragg-reshard"), "convert",
                    "--src", str(work / "qwen3_moe"), "--dst", str(out), "--model", "qwen3_moe",
                    "--hf-config-dir", str(work / "qwen3_moe-hf-config"), "--threads", "2",
                    "--verify"], check=True, stdout=log, stderr=log, timeout=300)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    print(f"  trainer: step 1 converted by bragg-reshard: {len(index['weight_map'])} tensors "
          f"in {len(shards)} safetensors shard(s), verified against the Megatron chunks",
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
    try:
        urls = []
        for i in range(WORKERS):
            p, url = start([str(build / "src/gateway/sim/bragg-sim-worker"), "--listen",
                            "127.0.0.1:0", "--seed", "7", "--moe-layers", str(MOE_LAYERS),
                            "--moe-topk", str(MOE_TOPK), "--num-experts", "16", "--decode-us",
                            "3000", "--prefill-us", "2"], log)
            procs.append(p)
            urls.append(url)
        argv = [str(build / "src/gateway/bragg-gateway"), "--listen", "127.0.0.1:0",
                "--policy", "sticky"]
        for u in urls:
            argv += ["--worker", u]
        p, gw = start(argv, log)
        procs.append(p)
        print(f"gateway {gw} (sticky) in front of {WORKERS} simulated workers; {ROLLOUTS} "
              f"rollouts x {TURNS} turns, a pbox sandbox each for their tool calls", flush=True)

        turns_done = [0]
        lock = threading.Lock()
        update: Dict = {}
        ready_to_update = threading.Event()  # a third of the turns are done

        # The trainer's step 1 is ready before the rollouts start; the fleet loads it once a
        # third of the turns are done, so that the update always lands mid-step.
        path = publish_step(build, root / "trainer", log)

        def trainer() -> None:
            try:
                ready_to_update.wait(timeout=300)
                t0 = time.monotonic()
                status, report = post(gw + "/weights/update",
                                      {"model_path": str(path), "weight_version": "1"})
                update.update(status=status, report=report, ms=(time.monotonic() - t0) * 1e3)
                with lock:
                    at = turns_done[0]
                print(f"  fleet weight update to version 1 ({path.name}): HTTP {status} in "
                      f"{update['ms']:.0f} ms, at {at} of {ROLLOUTS * TURNS} turns", flush=True)
            except Exception as e:  # noqa: BLE001 - reported below
                update.update(status=0, error=f"{type(e).__name__}: {e}")

        results: Dict[int, Dict] = {}

        def rollout(session, r: int) -> None:
            rng = random.Random(100 + r)
            rid = f"rollout-{r}"
            client = bgc.RolloutClient(gw, return_routed_experts=True)
            sb = session.create(memory="256M", disk="64M", labels={"rollout": str(r)})
            ctx = SYSTEM_PROMPT + [rng.randrange(32000) for _ in range(rng.randint(32, 128))]
            turns = []
            try:
                for t in range(TURNS):
                    t_gen = time.monotonic()
                    res = client.generate(rid, ctx, {"max_new_tokens": rng.randint(12, 32),
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
                    ctx = ctx + out + [1000 + ord(c) for c in text.strip()]
                    with lock:
                        turns_done[0] += 1
                        if turns_done[0] >= ROLLOUTS * TURNS // 3:
                            ready_to_update.set()
                held = list(client.routed_experts(rid))
                # A full request on the same rollout (so on the same worker): its array must
                # begin with the one assembled from the per-turn suffixes.
                full = bgc.RolloutClient(gw, return_routed_experts=True, delta=False)
                full.generate(rid, ctx, {"max_new_tokens": 1})
                whole = list(full.routed_experts(rid))
                # One row of experts per context token (the full request's prompt is ctx).
                experts = np.asarray(whole, dtype=np.int32).reshape(-1, MOE_LAYERS, MOE_TOPK)
                results[r] = {"turns": turns, "tokens": len(ctx),
                              "experts_equal": whole[:len(held)] == held and len(held) > 0,
                              "experts": experts[:len(ctx)],
                              "ids": np.asarray(ctx, dtype=np.int32)}
                client.forget(rid)
            finally:
                sb.destroy(missing_ok=True)

        t_start = time.monotonic()
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
        prompt = cached = spanning = 0
        versions: Dict[str, int] = {}
        gen_ms: List[float] = []
        tool_ms: List[float] = []
        for r, res in sorted(results.items()):
            if not res["experts_equal"]:
                errors.append(f"rollout {r}: delta routed experts differ from the full array")
            prev_total = 0
            for t, turn in enumerate(res["turns"]):
                prompt += turn["prompt"]
                cached += turn["cached"]
                versions[turn["version"]] = versions.get(turn["version"], 0) + 1
                # Sticky: all the rollout's earlier tokens (prompt + output) are cached.
                if t > 0 and turn["cached"] < prev_total - 1:
                    errors.append(f"rollout {r} turn {t}: {turn['cached']} cached tokens, "
                                  f"{prev_total - 1} expected on its worker")
                prev_total = turn["prompt"] + turn["out"]
                gen_ms.append(turn["gen_ms"])
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
        print(f"rollouts: {len(results)}/{ROLLOUTS} in {elapsed:.1f} s; token-weighted cache "
              f"hit rate {hit:.3f} (the 512-token system prompt shared by all); turns per weight "
              f"version {dict(sorted(versions.items()))}", flush=True)
        if load:
            print(f"requests per worker: {sorted(int(v) for v in load.values())}", flush=True)
        if gen_ms:
            gen_ms.sort()
            tool_ms.sort()
            print(f"per turn p50: generate {gen_ms[len(gen_ms) // 2]:.0f} ms (decode 3 ms per "
                  f"token), tool call in its sandbox {tool_ms[len(tool_ms) // 2]:.0f} ms; "
                  f"{spanning} turn(s) generated across the weight update (output spans "
                  "on both versions)", flush=True)

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
