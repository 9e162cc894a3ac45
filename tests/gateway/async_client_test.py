"""bragg_gateway.AsyncRolloutClient (aiohttp) against bragg-gateway and two bragg-sim-workers on
loopback, under the Python peer environment (which pins aiohttp)."""

import asyncio
import os
import subprocess
import unittest

import bragg_gateway as bgc  # on PYTHONPATH=<build>/python


def start(argv):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        p.kill()
        raise RuntimeError(f"{argv[0]} did not start: {line!r}")
    p.stdout.close()
    return p, line.split()[-1]


class AsyncClientTest(unittest.TestCase):
    def setUp(self):
        self.procs = []
        argv = [os.environ["BRAGG_GATEWAY"], "--listen", "127.0.0.1:0", "--api-key", "k"]
        for _ in range(2):
            p, url = start([os.environ["BRAGG_SIM_WORKER"], "--listen", "127.0.0.1:0", "--seed",
                            "5", "--moe-layers", "3", "--moe-topk", "2", "--decode-us", "2000"])
            self.procs.append(p)
            argv += ["--worker", url]
        p, self.gw = start(argv)
        self.procs.append(p)

    def tearDown(self):
        for p in self.procs:
            p.kill()
            p.wait()

    def test_many_rollouts_at_once_keep_their_experts(self):
        async def rollout(delta, whole, k):
            convo = [(k * 31 + i) % 3000 + 1 for i in range(64)]
            for turn in range(3):
                if turn % 2:
                    events = [e async for e in delta.generate_stream(f"d{k}", convo,
                                                                     {"max_new_tokens": 6})]
                    got = events[-1]
                else:
                    got = await delta.generate(f"d{k}", convo, {"max_new_tokens": 6})
                want = await whole.generate(f"w{k}", convo, {"max_new_tokens": 6})
                assert got["output_ids"] == want["output_ids"], (k, turn)
                assert delta.routed_experts(f"d{k}") == whole.routed_experts(f"w{k}"), (k, turn)
                convo += want["output_ids"] + [2000 + turn] * 8
            await delta.forget(f"d{k}")
            await whole.forget(f"w{k}")
            return len(convo)

        async def main():
            async with bgc.AsyncRolloutClient(self.gw, return_routed_experts=True,
                                              api_key="k") as delta, \
                    bgc.AsyncRolloutClient(self.gw, return_routed_experts=True, delta=False,
                                           api_key="k") as whole:
                return await asyncio.gather(*(rollout(delta, whole, k) for k in range(32)))

        lengths = asyncio.run(main())
        self.assertEqual(lengths, [64 + 3 * (6 + 8)] * 32)

    def test_errors(self):
        async def main():
            async with bgc.AsyncRolloutClient(self.gw) as no_key:
                with self.assertRaises(bgc.GatewayError) as e:
                    await no_key.generate("r", [1, 2], {})
                self.assertEqual(e.exception.status, 401)
                with self.assertRaises(bgc.GatewayError) as e:
                    [x async for x in no_key.generate_stream("r", [1, 2], {})]
                self.assertEqual(e.exception.status, 401)
            async with bgc.AsyncRolloutClient(self.gw, api_key="k") as c:
                with self.assertRaises(bgc.GatewayError) as e:
                    await c.generate("r", [], {})
                self.assertEqual(e.exception.status, 400)
                c2 = bgc.AsyncRolloutClient(self.gw, return_routed_experts=True, api_key="k")
                await c2.generate("x", list(range(1, 40)), {"max_new_tokens": 2})
                with self.assertRaises(ValueError):  # shorter than what it covered
                    await c2.generate("x", [1, 2], {})
                await c2.close()
            async with bgc.AsyncRolloutClient("http://127.0.0.1:1", timeout=2) as dead:
                with self.assertRaises(bgc.GatewayError):
                    await dead.generate("z", [1], {})
            # 200 tokens at 2 ms each take 0.4 s: a 0.1 s timeout ends the call, and the next
            # call on the same client still works.
            async with bgc.AsyncRolloutClient(self.gw, api_key="k", timeout=0.1) as slow:
                with self.assertRaises(bgc.GatewayError) as e:
                    await slow.generate("t", [1, 2, 3], {"max_new_tokens": 200})
                self.assertIn("within 0.1 s", str(e.exception))
                res = await slow.generate("t2", [1, 2, 3], {"max_new_tokens": 1})
                self.assertEqual(len(res["output_ids"]), 1)

        asyncio.run(main())

    def test_with_bad_arguments(self):
        with self.assertRaises(ValueError):
            bgc.AsyncRolloutClient("127.0.0.1:1")


if __name__ == "__main__":
    unittest.main()
