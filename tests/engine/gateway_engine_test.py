"""bragg-gateway in front of two real bragg-engine workers (a tiny random Qwen3-MoE): what the
gateway's own tests check against bragg-sim-worker, now with a real model behind it.

- multi-turn rollouts stick to their worker and later turns prefill only their new tokens;
- routed experts assembled from per-turn deltas equal a full request's (a real MoE router);
- a fleet weight update with requests in flight: none is lost, spans name both versions, the
  workers and the gateway agree on the new version; a bad directory fails safe (old version kept,
  generation unchanged);
- streaming through the gateway ends with [DONE]; a client hanging up mid-stream aborts the
  request on its worker (the gateway's /abort_request) and frees its KV blocks;
- greedy decoding is the same on both workers (same weights, same tokens).
"""

import concurrent.futures as cf
import json
import os
import subprocess
import tempfile
import time
import unittest
import urllib.error
import urllib.request

import bragg_gateway as bgc  # on PYTHONPATH=<build>/python

ENGINE = os.environ["BRAGG_ENGINE"]
GATEWAY = os.environ["BRAGG_GATEWAY"]
WRITE = os.environ["BRAGG_WRITE_TINY_MODEL"]
LAYERS, TOPK = 2, 2


def start(argv):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        p.kill()
        p.wait()
        raise RuntimeError(f"{argv[0]} did not start: {line!r}")
    return p, line.split()[-1]


def post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


class GatewayOverEngine(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="bragg-gw-engine-")
        cls.v0 = os.path.join(cls.tmp.name, "v0")
        cls.v1 = os.path.join(cls.tmp.name, "v1")
        cls.wide = os.path.join(cls.tmp.name, "wide")
        subprocess.run([WRITE, cls.v0, "--layers", str(LAYERS)], check=True)
        subprocess.run([WRITE, cls.v1, "--layers", str(LAYERS), "--scale", "0.5"], check=True)
        subprocess.run([WRITE, cls.wide, "--layers", str(LAYERS + 1)], check=True)
        cls.procs = []
        cls.workers = []
        for _ in range(2):
            p, url = start([ENGINE, "--model", cls.v0, "--listen", "127.0.0.1:0", "--threads", "1",
                            "--weight-version", "0", "--kv-cache-tokens", "16384"])
            cls.procs.append(p)
            cls.workers.append(url)
        argv = [GATEWAY, "--listen", "127.0.0.1:0"]
        for u in cls.workers:
            argv += ["--worker", u]
        p, cls.gw = start(argv)
        cls.procs.append(p)

    @classmethod
    def tearDownClass(cls):
        for p in cls.procs:
            p.kill()
            p.wait()
        cls.tmp.cleanup()

    def test_1_sticky_turns_reuse_the_cache_and_deltas_equal_full_experts(self):
        delta = bgc.RolloutClient(self.gw, return_routed_experts=True, delta=True)
        full = bgc.RolloutClient(self.gw, return_routed_experts=True, delta=False)
        convo = [(i * 37) % 256 for i in range(100)]
        greedy = {"max_new_tokens": 12, "temperature": 0}
        for turn in range(4):
            d = delta.generate("d", convo, greedy)
            f = full.generate("f", convo, greedy)
            self.assertEqual(d["output_ids"], f["output_ids"], f"turn {turn}")
            total = len(convo) + len(d["output_ids"])
            self.assertEqual(len(delta.routed_experts("d")), (total - 1) * LAYERS * TOPK)
            self.assertEqual(delta.routed_experts("d"), full.routed_experts("f"), f"turn {turn}")
            self.assertTrue(all(0 <= e < 8 for e in delta.routed_experts("d")))
            if turn > 0:
                # Everything but the new tail (and the partial last block) came from the cache.
                self.assertGreaterEqual(d["meta_info"]["cached_tokens"], len(convo) - 20 - 16)
            convo += d["output_ids"] + [(11 * turn + k) % 256 for k in range(20)]

    def test_2_both_workers_greedy_alike(self):
        prompt = [(i * 13) % 256 for i in range(40)]
        outs = []
        for w in self.workers:
            status, res = post(w + "/generate", {"input_ids": prompt, "sampling_params":
                                                 {"max_new_tokens": 16, "temperature": 0}})
            self.assertEqual(status, 200, res)
            outs.append(res["output_ids"])
        self.assertEqual(outs[0], outs[1])

    def test_3_stream_and_abort_through_the_gateway(self):
        req = urllib.request.Request(self.gw + "/generate", data=json.dumps({
            "input_ids": [1, 2, 3, 4], "stream": True,
            "sampling_params": {"max_new_tokens": 20, "temperature": 0}}).encode(),
            headers={"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
        self.assertEqual(events[-1], "[DONE]")
        last = json.loads(events[-2])
        self.assertEqual(len(last["output_ids"]), 20)
        self.assertEqual(last["meta_info"]["finish_reason"]["type"], "length")

        # A client that hangs up mid-stream: the gateway sends /abort_request {rid} to the
        # worker, which ends the request and frees its KV blocks.
        req = urllib.request.Request(self.gw + "/generate", data=json.dumps({
            "input_ids": [5, 6, 7], "stream": True, "rid": "hang-up",
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0,
                                "ignore_eos": True}}).encode(),
            headers={"Content-Type": "application/json"})
        r = urllib.request.urlopen(req, timeout=60)
        seen = 0
        for line in r:
            seen += line.startswith(b"data: ")
            if seen == 3:
                break
        r.close()

        def states():
            return [get(w + "/get_server_info")["internal_states"][0] for w in self.workers]

        for _ in range(1000):
            if all(s["running"] == 0 for s in states()):
                break
            time.sleep(0.01)
        self.assertTrue(all(s["running"] == 0 and s["kv_tokens_used"] == 0 for s in states()),
                        states())
        self.assertGreaterEqual(sum(s["aborted_total"] for s in states()), 1)

    def test_4_fleet_update_in_flight_and_a_bad_directory_fails_safe(self):
        prompt = [(i * 7) % 256 for i in range(30)]
        greedy = {"max_new_tokens": 10, "temperature": 0}
        _, before = post(self.gw + "/generate", {"input_ids": prompt, "sampling_params": greedy})

        status, report = post(self.gw + "/weights/update",
                              {"model_path": self.wide, "weight_version": "bad"})
        self.assertNotEqual(status, 200, report)
        for w in self.workers:
            self.assertEqual(get(w + "/get_model_info")["weight_version"], "0")
        _, same = post(self.gw + "/generate", {"input_ids": prompt, "sampling_params": greedy})
        self.assertEqual(before["output_ids"], same["output_ids"])

        def rollout(k):
            return post(self.gw + "/generate", {
                "input_ids": [(k * 5 + i) % 256 for i in range(20)], "routing_key": f"u{k}",
                "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}})

        with cf.ThreadPoolExecutor(16) as pool:
            futs = [pool.submit(rollout, k) for k in range(16)]
            status, report = post(self.gw + "/weights/update",
                                  {"model_path": self.v1, "weight_version": "1"})
            self.assertEqual(status, 200, report)
            results = [f.result(timeout=300) for f in futs]
        spanning = 0
        for status, res in results:
            self.assertEqual(status, 200, res)
            self.assertEqual(len(res["output_ids"]), 150)
            spans = res["meta_info"]["weight_versions"]
            self.assertEqual(spans[0]["start"], 0)
            self.assertEqual(spans[-1]["end"], 150)
            self.assertEqual(spans[-1]["version"], "1")
            spanning += len(spans) == 2 and spans[0]["version"] == "0"
        self.assertGreater(spanning, 0, "no request ran across the update")
        for w in self.workers:
            info = get(w + "/get_model_info")
            self.assertEqual(info["weight_version"], "1")
            self.assertEqual(info["model_path"], self.v1)
        _, after = post(self.gw + "/generate", {"input_ids": prompt, "sampling_params": greedy})
        self.assertEqual(after["meta_info"]["weight_version"], "1")
        self.assertNotEqual(after["output_ids"], before["output_ids"])


if __name__ == "__main__":
    unittest.main()
