"""Python client against bragg-gateway and two bragg-sim-workers on loopback."""

import base64
import http.server
import json
import os
import struct
import subprocess
import threading
import time
import unittest

import bragg_gateway as bgc  # on PYTHONPATH=<build>/python


def start(argv):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        p.kill()
        raise RuntimeError(f"{argv[0]} did not start: {line!r}")
    return p, line.split()[-1]


class ClientTest(unittest.TestCase):
    def setUp(self):
        self.procs = []
        urls = []
        for _ in range(2):
            p, url = start([os.environ["BRAGG_SIM_WORKER"], "--listen", "127.0.0.1:0", "--seed",
                            "3", "--moe-layers", "5", "--moe-topk", "3"])
            self.procs.append(p)
            urls.append(url)
        argv = [os.environ["BRAGG_GATEWAY"], "--listen", "127.0.0.1:0"]
        for u in urls:
            argv += ["--worker", u]
        p, self.gw = start(argv)
        self.procs.append(p)

    def tearDown(self):
        for p in self.procs:
            p.kill()
            p.wait()

    def test_delta_equals_full_every_turn(self):
        delta = bgc.RolloutClient(self.gw, return_routed_experts=True, delta=True)
        full = bgc.RolloutClient(self.gw, return_routed_experts=True, delta=False)
        convo = [(i * 37) % 5000 for i in range(300)]
        for turn in range(5):
            d = delta.generate("d", convo, {"max_new_tokens": 12})
            f = full.generate("f", convo, {"max_new_tokens": 12})
            self.assertEqual(d["output_ids"], f["output_ids"])
            total = len(convo) + len(d["output_ids"])
            self.assertEqual(len(delta.routed_experts("d")), (total - 1) * 5 * 3)
            self.assertEqual(delta.routed_experts("d"), full.routed_experts("f"), f"turn {turn}")
            if turn > 0:
                self.assertGreater(d["meta_info"]["cached_tokens"], 0)
                self.assertLess(d["meta_info"]["routed_experts_bytes"] * 4,
                                f["meta_info"]["routed_experts_bytes"])
            convo += d["output_ids"] + [7000 + turn] * 20

    def test_errors(self):
        with self.assertRaises(ValueError):
            bgc.RolloutClient("127.0.0.1:1")
        c = bgc.RolloutClient(self.gw, return_routed_experts=True)
        c.generate("x", list(range(50)), {"max_new_tokens": 2})
        with self.assertRaises(ValueError):
            c.generate("x", [1, 2], {"max_new_tokens": 2})  # shorter than what it covered
        with self.assertRaises(bgc.GatewayError) as e:
            c.generate("y", [], {})
        self.assertEqual(e.exception.status, 400)
        dead = bgc.RolloutClient("http://127.0.0.1:1", timeout=2)
        with self.assertRaises(bgc.GatewayError):
            dead.generate("z", [1], {})

    def test_forget_releases_the_rollout_on_the_gateway(self):
        c = bgc.RolloutClient(self.gw)

        def rollouts():
            with bgc.urllib.request.urlopen(self.gw + "/workers", timeout=10) as r:
                return sum(w["rollouts"] for w in json.loads(r.read())["workers"])

        for k in range(3):
            c.generate(f"r{k}", [1, 2, 3, k], {"max_new_tokens": 1})
        self.assertEqual(rollouts(), 3)
        c.forget("r1")
        self.assertEqual(rollouts(), 2)
        c.forget("never-seen")  # harmless
        self.assertEqual(rollouts(), 2)
        dead = bgc.RolloutClient("http://127.0.0.1:1", timeout=2)
        with self.assertRaises(bgc.GatewayError):
            dead.forget("r0")


class StreamAndKeyTest(unittest.TestCase):
    """generate_stream keeps the routed-experts bookkeeping of generate(); the API key."""

    def setUp(self):
        self.procs = []
        p, worker = start([os.environ["BRAGG_SIM_WORKER"], "--listen", "127.0.0.1:0", "--seed",
                           "3", "--moe-layers", "4", "--moe-topk", "2"])
        self.procs.append(p)
        p, self.gw = start([os.environ["BRAGG_GATEWAY"], "--listen", "127.0.0.1:0", "--worker",
                            worker, "--api-key", "k1"])
        self.procs.append(p)

    def tearDown(self):
        for p in self.procs:
            p.kill()
            p.wait()

    def test_streamed_turns_equal_whole_ones(self):
        streamed = bgc.RolloutClient(self.gw, return_routed_experts=True, api_key="k1")
        whole = bgc.RolloutClient(self.gw, return_routed_experts=True, delta=False,
                                  api_key="k1")
        convo = list(range(1, 120))
        for turn in range(3):
            events = list(streamed.generate_stream("s", convo, {"max_new_tokens": 8}))
            res = whole.generate("w", convo, {"max_new_tokens": 8})
            self.assertGreaterEqual(len(events), 2, "one event per token, then the answer")
            self.assertEqual(events[-1]["output_ids"], res["output_ids"])
            self.assertNotIn("routed_experts", events[-1]["meta_info"])
            self.assertEqual(streamed.routed_experts("s"), whole.routed_experts("w"), turn)
            convo += res["output_ids"] + [900 + turn] * 10

    def test_api_key(self):
        with self.assertRaises(bgc.GatewayError) as e:
            bgc.RolloutClient(self.gw).generate("r", [1, 2], {"max_new_tokens": 1})
        self.assertEqual(e.exception.status, 401)
        with self.assertRaises(bgc.GatewayError) as e:
            list(bgc.RolloutClient(self.gw, api_key="wrong").generate_stream("r", [1, 2], {}))
        self.assertEqual(e.exception.status, 401)
        ok = bgc.RolloutClient(self.gw, api_key="k1")
        self.assertEqual(len(ok.generate("r", [1, 2], {"max_new_tokens": 3})["output_ids"]), 3)
        ok.forget("r")


class _BadStream(http.server.BaseHTTPRequestHandler):
    """Streams what the class says: an error event, or events without an answer."""
    lines = []

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in _BadStream.lines:
            self.wfile.write(line)

    def log_message(self, *args):
        pass


class BadStreamTest(unittest.TestCase):
    def test_broken_streams_raise(self):
        srv = http.server.HTTPServer(("127.0.0.1", 0), _BadStream)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        c = bgc.RolloutClient(f"http://127.0.0.1:{srv.server_port}", timeout=10)
        try:
            for lines, message in (
                    ([b'data: {"text": "a"}\n\n', b'data: {"error": "worker died"}\n\n'],
                     "worker died"),
                    ([b"data: [DONE]\n\n"], "without an answer"),
                    ([b"data: {not json\n\n"], "not JSON"),
                    ([b'data: {"text": "a"}\n\n'], "no meta_info")):
                _BadStream.lines = lines
                with self.assertRaises(bgc.GatewayError) as e:
                    list(c.generate_stream("b", [1], {}))
                self.assertIn(message, str(e.exception))
        finally:
            srv.shutdown()
            srv.server_close()


class _Hostile(http.server.BaseHTTPRequestHandler):
    """Answers /generate with 2 routed-expert ids per position on the first call, 3 after."""
    calls = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        width = 2 if _Hostile.calls == 0 else 3
        _Hostile.calls += 1
        n = len(body["input_ids"]) + 1 - 1 - body.get("routed_experts_start_len", 0)
        ids = struct.pack(f"<{n * width}i", *range(n * width))
        out = json.dumps({"output_ids": [9], "meta_info": {
            "routed_experts": base64.b64encode(ids).decode()}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


class WidthTest(unittest.TestCase):
    def test_width_change_is_an_error(self):
        srv = http.server.HTTPServer(("127.0.0.1", 0), _Hostile)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        try:
            c = bgc.RolloutClient(f"http://127.0.0.1:{srv.server_port}",
                                  return_routed_experts=True)
            c.generate("w", [1, 2, 3], {})
            self.assertEqual(len(c.routed_experts("w")), 3 * 2)
            with self.assertRaises(bgc.GatewayError) as e:
                c.generate("w", [1, 2, 3, 9, 4, 5], {})
            self.assertIn("width changed", str(e.exception))
        finally:
            srv.shutdown()
            srv.server_close()


class StreamPassThroughTest(unittest.TestCase):
    """A streamed answer reaches the client event by event, not held until its end: the worker
    emits one token every 60 ms, so the first event must arrive long before the last."""

    def test_events_arrive_as_the_worker_sends_them(self):
        procs = []
        try:
            p, worker = start([os.environ["BRAGG_SIM_WORKER"], "--listen", "127.0.0.1:0",
                               "--decode-us", "60000"])
            procs.append(p)
            p, gw = start([os.environ["BRAGG_GATEWAY"], "--listen", "127.0.0.1:0",
                           "--worker", worker])
            procs.append(p)
            req = bgc.urllib.request.Request(gw + "/generate", data=json.dumps({
                "input_ids": [1, 2, 3], "stream": True,
                "sampling_params": {"max_new_tokens": 12}}).encode(),
                headers={"Content-Type": "application/json"})
            arrivals = []
            with bgc.urllib.request.urlopen(req, timeout=60) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        arrivals.append(time.monotonic())
            self.assertGreaterEqual(len(arrivals), 13)  # 12 tokens, then the final answer
            # 12 x 60 ms of decoding lie between the first token and the end; a gateway that
            # buffered the stream would deliver every event within a few ms of the last.
            self.assertGreater(arrivals[-1] - arrivals[0], 0.3,
                               "the gateway held the stream back until its end")
        finally:
            for p in procs:
                p.kill()
                p.wait()


if __name__ == "__main__":
    unittest.main()
