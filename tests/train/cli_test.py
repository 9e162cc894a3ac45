#!/usr/bin/env python3
"""bragg-train from the command line, as a user drives it: a trajectory file in, a model the engine
loads out; kill -9 mid-run and --resume ends with the uninterrupted run's weights bit for bit;
a bad trajectory file is refused before anything is trained or written; two data-parallel
processes deal a heavy-tailed batch by cost or round-robin (--dp-balance) and report the ranks'
balance in their metrics.

Run by ctest (train_cli_test) with BRAGG_TRAIN, BRAGG_ENGINE_SCORE and BRAGG_WRITE_TINY_MODEL set.
"""

import json
import os
import random
import signal
import subprocess
import tempfile
import time
import unittest

TRAIN = os.environ.get("BRAGG_TRAIN", "bragg-train")
SCORE = os.environ.get("BRAGG_ENGINE_SCORE", "bragg-engine-score")
WRITE = os.environ.get("BRAGG_WRITE_TINY_MODEL", "write_tiny_model")
VOCAB = 64


class TrainCliTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="bragg-train-cli-")
        cls.dir = cls.tmp.name
        cls.model = os.path.join(cls.dir, "model")
        subprocess.run([WRITE, cls.model, "--vocab", str(VOCAB)], check=True)
        rng = random.Random(5)
        raw = []
        for i in range(16):
            n = rng.randint(12, 60)
            tokens = [rng.randrange(VOCAB) for _ in range(n)]
            mask = [0] * (n // 3) + [1] * (n - n // 3)
            raw.append({"id": f"r{i}", "group": f"g{i // 4}", "tokens": tokens, "loss_mask": mask,
                        "logprobs": [0.0] * n, "reward": float(rng.random() < 0.5)})
        cls.raw_path = cls.path("raw.jsonl", raw)
        # The behaviour log-probs: the model's own (what a rollout on these weights returned).
        out = subprocess.run([TRAIN, "logprobs", "--model", cls.model, "--trajectories",
                              cls.raw_path, "--deterministic"],
                             check=True, capture_output=True, text=True).stdout
        lps = {json.loads(l)["id"]: json.loads(l)["logprobs"] for l in out.splitlines()}
        for t in raw:
            t["logprobs"] = lps[t["id"]]
        cls.trajectories = cls.path("trajectories.jsonl", raw)
        cls.raw = raw

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def path(cls, name, rows):
        p = os.path.join(cls.dir, name)
        with open(p, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        return p

    def train_argv(self, name, steps=6):
        return [TRAIN, "--model", self.model, "--trajectories", self.trajectories,
                "--steps", str(steps), "--batch-size", "8", "--deterministic", "--lr", "1e-2",
                "--threads", "1", "--checkpoint-dir", os.path.join(self.dir, name + "-ckpt"),
                "--checkpoint-every", "1", "--metrics", os.path.join(self.dir, name + ".jsonl"),
                "--out", os.path.join(self.dir, name + "-out")]

    def metrics(self, name):
        p = os.path.join(self.dir, name + ".jsonl")
        if not os.path.exists(p):
            return []
        with open(p) as f:
            return [json.loads(l) for l in f if l.strip()]

    def test_trains_resumes_after_kill_9_bit_for_bit_and_the_engine_loads_it(self):
        subprocess.run(self.train_argv("whole"), check=True)
        whole = self.metrics("whole")
        self.assertEqual([m["version"] for m in whole], [1, 2, 3, 4, 5, 6])
        for m in whole:
            self.assertEqual(m["trajectories"], 8)
        # Step 1 is on-policy (the behaviour log-probs are the model's own, deterministic mode);
        # later steps train on the same trajectories off-policy, weighted by importance ratios.
        self.assertEqual(whole[0]["logprob_diff_max"], 0.0)
        self.assertEqual(whole[0]["is_weight_mean"], 1.0)
        self.assertGreater(whole[-1]["logprob_diff_max"], 0.0)
        # Interrupted: kill -9 once three steps are done, then resume.
        p = subprocess.Popen(self.train_argv("cut"), stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while len(self.metrics("cut")) < 3 and p.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        p.wait()
        done = len(self.metrics("cut"))
        self.assertGreaterEqual(done, 3)
        subprocess.run(self.train_argv("cut") + ["--resume"], check=True)
        cut = self.metrics("cut")
        # Every step once: a metrics line is written after its step's checkpoint.
        self.assertEqual([m["version"] for m in cut], [1, 2, 3, 4, 5, 6])
        with open(os.path.join(self.dir, "whole-out", "model.safetensors"), "rb") as a, \
                open(os.path.join(self.dir, "cut-out", "model.safetensors"), "rb") as b:
            self.assertEqual(a.read(), b.read(),
                             "resumed weights differ from the uninterrupted run's")
        # The engine loads the trained model and decodes from it.
        ids = os.path.join(self.dir, "ids.json")
        with open(ids, "w") as f:
            json.dump(self.raw[0]["tokens"][:10], f)
        out = subprocess.run([SCORE, "--model", os.path.join(self.dir, "whole-out"), "--ids", ids,
                              "--greedy", "5"], check=True, capture_output=True, text=True).stdout
        self.assertEqual(len(json.loads(out)["output_ids"]), 5)

    def test_a_bad_trajectory_file_is_refused_before_anything_is_written(self):
        bad = [dict(t) for t in self.raw[:4]]
        bad[2] = dict(bad[2], logprobs=bad[2]["logprobs"][:-1])
        path = self.path("bad.jsonl", bad)
        argv = self.train_argv("bad", steps=2)
        argv[argv.index(self.trajectories)] = path
        r = subprocess.run(argv, capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn("trajectory r2", r.stderr)
        self.assertIn("logprobs has", r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "bad-out")))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "bad-ckpt")))
        # Not JSON, and an unknown field: file and line named.
        with open(path, "a") as f:
            f.write("{not json\n")
        r = subprocess.run(argv, capture_output=True, text=True)
        self.assertEqual(r.returncode, 1)
        self.assertIn("bad.jsonl:5", r.stderr)

    def test_dp_balance_by_cost_evens_two_processes_where_round_robin_does_not(self):
        # Two long trajectories at positions 0 and 2, ten short ones: round-robin (trajectory i
        # to rank i mod 2) deals both long ones to rank 0. Packed, a trajectory is its tokens but
        # the last: 2 x 119 + 10 x 7 = 308, 154 a rank.
        rng = random.Random(7)
        rows = []
        for i in range(12):
            n = 120 if i in (0, 2) else 8
            rows.append({"id": f"h{i}", "group": f"g{i // 4}",
                         "tokens": [rng.randrange(VOCAB) for _ in range(n)],
                         "loss_mask": [0] + [1] * (n - 1), "logprobs": [0.0] * n,
                         "reward": float(i % 3)})
        path = self.path("heavy.jsonl", rows)
        got = {}
        for balance in ("cost", "round-robin"):
            procs = []
            for rank in range(2):
                argv = [TRAIN, "--model", self.model, "--trajectories", path, "--objective", "sft",
                        "--steps", "2", "--threads", "1", "--world-size", "2", "--rank", str(rank),
                        "--rendezvous", "file:" + os.path.join(self.dir, f"rendezvous-{balance}"),
                        "--dp-balance", balance,
                        "--metrics", os.path.join(self.dir, f"dp-{balance}-{rank}.jsonl")]
                procs.append(subprocess.Popen(argv, stderr=subprocess.PIPE, text=True))
            for p in procs:
                _, err = p.communicate(timeout=300)
                self.assertEqual(p.returncode, 0, err)
                self.assertIn("ranks: time max/mean", err)
            per_rank = [self.metrics(f"dp-{balance}-{rank}") for rank in range(2)]
            self.assertEqual(len(per_rank[0]), 2)
            for a, b in zip(*per_rank):
                for key in ("rank_tokens_max", "rank_tokens_mean", "loss"):
                    self.assertEqual(a[key], b[key], key)
                self.assertGreaterEqual(a["rank_seconds_max"], a["rank_seconds_mean"])
                self.assertGreater(a["rank_seconds_mean"], 0)
            got[balance] = per_rank[0][-1]
        self.assertEqual(got["cost"]["rank_tokens_mean"], 154)
        self.assertEqual(got["round-robin"]["rank_tokens_mean"], 154)
        self.assertEqual(got["cost"]["rank_tokens_max"], 154)
        self.assertEqual(got["round-robin"]["rank_tokens_max"], 2 * 119 + 4 * 7)

    def test_an_unknown_dp_balance_is_refused_before_anything_is_written(self):
        argv = self.train_argv("unknown-balance", steps=1) + ["--dp-balance", "lpt"]
        r = subprocess.run(argv, capture_output=True, text=True)
        self.assertEqual(r.returncode, 1, r.stderr)
        self.assertIn('unknown data-parallel balance "lpt" (cost or round-robin)', r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "unknown-balance-out")))
        self.assertFalse(os.path.exists(os.path.join(self.dir, "unknown-balance-ckpt")))
        self.assertEqual(self.metrics("unknown-balance"), [])



if __name__ == "__main__":
    unittest.main()
