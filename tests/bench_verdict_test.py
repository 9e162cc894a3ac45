#!/usr/bin/python3
"""Unit tests of bench/verdict.py, the one verdict rule of docs/benchmarks.md's tables.

    python3 tests/bench_verdict_test.py      (exit 0 when every case passes)
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from verdict import MET, MISSED, RULE, TIE, Target, shown, spread, verdict  # noqa: E402


class AbsoluteTargets(unittest.TestCase):
    def test_lower_is_better(self):
        t = Target(20.0, "lower")
        self.assertEqual(verdict(t, [16.1, 17.0, 19.99]), MET)
        self.assertEqual(verdict(t, [20.0, 20.0]), MET)  # on the bound meets "<="
        self.assertEqual(verdict(t, [21.05, 22.1, 23.0]), MISSED)
        # pack's lognormal lpt+swaps row: best 16.07, median 20.05: straddles 20 ms.
        self.assertEqual(verdict(t, [16.07, 18.0, 20.05, 21.0, 22.0]), TIE)

    def test_higher_is_better(self):
        t = Target(1.5, "higher")
        self.assertEqual(verdict(t, [1.6, 1.74, 1.9]), MET)
        self.assertEqual(verdict(t, [1.0, 1.2, 1.49]), MISSED)
        self.assertEqual(verdict(t, [1.4, 1.74]), TIE)

    def test_median_alone_never_decides_met(self):
        # The median clears the bound by far, one run does not: not met.
        self.assertEqual(verdict(Target(2.0, "lower"), [1.0, 1.0, 1.0, 1.0, 2.5]), TIE)

    def test_single_run(self):
        self.assertEqual(verdict(Target(10.0, "lower"), [2.9]), MET)
        self.assertEqual(verdict(Target(10.0, "lower"), [10.1]), MISSED)

    def test_spread(self):
        self.assertEqual(spread(Target(1.0, "lower"), [3.0, 1.0, 2.0]), (1.0, 2.0, 3.0))


class RatioTargets(unittest.TestCase):
    def test_no_worse_than_peer_is_overlap(self):
        t = Target(1.0, "lower", ratio="ours/peer")
        # Disjoint and ours faster: met; disjoint and ours slower: missed.
        self.assertEqual(verdict(t, [150, 152, 154], [160, 161, 170]), MET)
        self.assertEqual(verdict(t, [160, 161, 170], [150, 152, 154]), MISSED)
        # pbox gvisor 154 ms against runsc pinned 152 ms (1.01x) with overlapping runs: a tie,
        # and so is 0.96x when the runs overlap: never "met" on the medians alone.
        self.assertEqual(verdict(t, [148, 154, 160], [145, 152, 158]), TIE)
        self.assertEqual(verdict(t, [150, 154, 165], [155, 161, 170]), TIE)

    def test_tie_iff_spreads_overlap(self):
        t = Target(1.0, "lower", ratio="ours/peer")
        cases = [([1, 2], [3, 4]), ([3, 4], [1, 2]), ([1, 3], [2, 4]), ([2, 3], [1, 4]),
                 ([1, 2], [2, 3])]
        for ours, peer in cases:
            overlap = min(ours) <= max(peer) and min(peer) <= max(ours)
            with self.subTest(ours=ours, peer=peer):
                self.assertEqual(verdict(t, ours, peer) == TIE,
                                 overlap and not max(ours) <= min(peer))

    def test_peer_over_ours_higher_is_better(self):
        # 1 MiB round trip >= 100x better than podman: podman's ms over ours.
        t = Target(100.0, "higher", ratio="peer/ours")
        self.assertEqual(verdict(t, [1.7, 1.8], [300.0, 330.0]), MET)  # worst: 300/1.8 = 167
        self.assertEqual(verdict(t, [1.7, 1.8], [150.0, 200.0]), TIE)  # 83x .. 118x
        self.assertEqual(verdict(t, [2.0, 3.0], [100.0, 150.0]), MISSED)  # best: 150/2 = 75
        lo, mid, hi = spread(t, [1.7, 1.8], [300.0, 330.0])
        self.assertAlmostEqual(lo, 300.0 / 1.8)
        self.assertAlmostEqual(mid, 315.0 / 1.75)
        self.assertAlmostEqual(hi, 330.0 / 1.7)

    def test_ratio_of_medians_is_reported_not_judged(self):
        # Medians say 0.98x (faster) but the spreads overlap: the verdict is a tie.
        t = Target(1.0, "lower", ratio="ours/peer")
        ours, peer = [120, 126, 140], [118, 129, 135]
        self.assertLess(spread(t, ours, peer)[1], 1.0)
        self.assertEqual(verdict(t, ours, peer), TIE)


class HostileInput(unittest.TestCase):
    def test_bad_targets(self):
        with self.assertRaises(ValueError):
            Target(1.0, "smaller")
        with self.assertRaises(ValueError):
            Target(1.0, "lower", ratio="mine/theirs")

    def test_empty_runs(self):
        with self.assertRaises(ValueError):
            verdict(Target(1.0, "lower"), [])
        with self.assertRaises(ValueError):
            verdict(Target(1.0, "lower"), [None, None])
        with self.assertRaises(ValueError):
            verdict(Target(1.0, "lower", ratio="ours/peer"), [1.0], [])

    def test_peer_without_ratio_and_zero_denominator(self):
        with self.assertRaises(ValueError):
            verdict(Target(1.0, "lower"), [1.0], [2.0])
        with self.assertRaises(ValueError):
            verdict(Target(1.0, "lower", ratio="ours/peer"), [1.0], [0.0, 1.0])

    def test_none_runs_are_dropped(self):
        self.assertEqual(verdict(Target(2.0, "lower"), [1.0, None, 1.5]), MET)


class Wording(unittest.TestCase):
    def test_words(self):
        self.assertEqual(TIE, "tie (within noise)")
        self.assertEqual(shown(MISSED), "**missed**")
        self.assertEqual(shown(TIE), TIE)
        self.assertEqual(shown(MET), MET)
        for word in ("met", "missed", "tie (within noise)", "never counted as met"):
            self.assertIn(word, RULE)


class AsyncSyncJudge(unittest.TestCase):
    """bench/rl/async_sync.py's targets, judged per pair (same seed): a run that never reached
    the reward target counts against async whichever side it is on."""

    @staticmethod
    def judge(async_times, sync_times, idle=(0.4, 0.6), step_s=(2.8, 3.0)):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                        "bench", "rl"))
        import argparse
        import async_sync
        runs = {"async": [{"time_to_target_s": t, "engine_idle_fraction": idle[0],
                           "seconds_per_step": step_s[0]} for t in async_times],
                "sync": [{"time_to_target_s": t, "engine_idle_fraction": idle[1],
                          "seconds_per_step": step_s[1]} for t in sync_times]}
        args = argparse.Namespace(target=0.75, window=3, time_limit_s=300.0)
        return {t["key"]: t for t in async_sync.judge(runs, args)}

    def test_sooner_everywhere_is_met(self):
        t = self.judge([100, 110], [130, 150])
        self.assertEqual(t["speedup"]["verdict"], MET)
        self.assertEqual(t["idle_ratio"]["verdict"], MET)
        self.assertEqual(t["step_rate"]["verdict"], MET)
        self.assertEqual(t["demo_time"]["verdict"], MET)

    def test_ratios_are_within_pairs(self):
        # Across pairs 100 s against 140 s would be a loss; within each pair async is sooner.
        t = self.judge([100, 150], [110, 160])
        self.assertEqual(t["speedup"]["verdict"], MET)
        self.assertAlmostEqual(t["speedup"]["spread"][0], 160 / 150)

    def test_async_not_reaching_is_never(self):
        t = self.judge([None, 100], [150, 150])
        self.assertEqual(t["speedup"]["verdict"], TIE)
        t = self.judge([None, None], [150, 150])
        self.assertEqual(t["speedup"]["verdict"], MISSED)
        self.assertEqual(t["demo_time"]["verdict"], MISSED)
        self.assertIn("not reached", t["demo_time"]["measured"])
        self.assertIsNone(t["demo_time"]["spread"][1])  # JSON has no infinity
        self.assertIsNone(t["demo_time"]["runs"][0])

    def test_sync_not_reaching_counts_as_its_limit(self):
        # Sync at its 300 s limit against async at 310 s: not a win for async.
        t = self.judge([310], [None])
        self.assertEqual(t["speedup"]["verdict"], MISSED)
        t = self.judge([290], [None])
        self.assertEqual(t["speedup"]["verdict"], MET)

    def test_busier_sync_engines_miss_the_idle_target(self):
        self.assertEqual(self.judge([100], [120], idle=(0.7, 0.5))["idle_ratio"]["verdict"],
                         MISSED)

    def test_slower_async_steps_miss_the_step_rate(self):
        self.assertEqual(self.judge([100], [120], step_s=(3.1, 3.0))["step_rate"]["verdict"],
                         MISSED)


if __name__ == "__main__":
    unittest.main()
