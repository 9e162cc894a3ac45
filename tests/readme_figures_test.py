#!/usr/bin/python3
"""The published numbers agree with docs/data: the README's figures (bench/readme_figures.py),
the summary table opening docs/benchmarks.md (bench/summary.py), every verdict word is one of
bench/verdict.py's, and every section of docs/benchmarks.md that `make bench` does not
regenerate says "manual run" in its heading.

    python3 tests/readme_figures_test.py      (exit 0 when every check passes)
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import readme_figures  # noqa: E402
import summary  # noqa: E402
from verdict import TIE  # noqa: E402

DATA = os.path.join(ROOT, "docs/data")
README = open(os.path.join(ROOT, "README.md")).read()
DOC = open(os.path.join(ROOT, "docs/benchmarks.md")).read()


def generated_regions(doc):
    """(start, end) offsets of what `make bench` writes: the summary, the pack section (up to
    the next "## " heading), and every "<!-- NAME:begin ... -->" .. "<!-- NAME:end -->" region
    (pbox-bench, engine)."""
    regions = []
    for m in re.finditer(r"<!-- ([a-z-]+):begin", doc):
        end = doc.find(f"<!-- {m.group(1)}:end -->", m.end())
        if end > 0:
            regions.append((m.start(), end))
    pack = re.search(r"^## pack\n.*?(?=^## |\Z)", doc, re.S | re.M)
    if pack:
        regions.append((pack.start(), pack.end()))
    return regions


def manual_figure(name):
    """The README's text of a manual figure, markers included."""
    m = re.search(rf"<!-- fig:{name} -->.*?<!-- /fig -->", README)
    return m.group(0) if m else None


class ReadmeFigures(unittest.TestCase):
    def test_readme_agrees_with_data(self):
        figs = readme_figures.expected(DATA)
        for name in readme_figures.KNOWN:
            self.assertIn(name, figs, f"docs/data gives no {name} figure")
        bad = readme_figures.disagreements(README, figs)
        self.assertEqual(bad, [], "\n".join(bad) + "\nrun bench/readme_figures.py")

    def test_every_known_figure_is_in_the_readme_once(self):
        names = re.findall(r"<!-- fig:([a-z0-9-]+) -->", README)
        self.assertEqual(sorted(names), sorted(readme_figures.KNOWN))

    def test_manual_figures_quote_the_data(self):
        with open(os.path.join(DATA, "manual_targets.json")) as f:
            manual = json.load(f)
        goals = [t["goal"] for t in manual["targets"]]
        self.assertEqual(len(goals), len(set(goals)), "manual targets' goals must be unique")
        verdicts = {r["goal"]: r["verdict"] for r in summary.manual_rows(manual)}
        byg = {t["goal"]: t for t in manual["targets"]}
        for name, goal, _ in readme_figures.MANUAL:
            self.assertIn(goal, byg, f"{name}: no manual target {goal!r}")
            fig = manual_figure(name)
            self.assertIsNotNone(fig, name)
            for part in (byg[goal]["measured"], f"{verdicts[goal]};",
                         f"manual run, {byg[goal]['date']})"):
                self.assertIn(part, fig, name)

    def test_a_hand_edited_manual_figure_fails_the_check(self):
        fig = manual_figure("reshard-memory")
        edited = README.replace(fig, "<!-- fig:reshard-memory -->54-178 MiB for 1-16 GB models "
                                     "(target <= 1 GiB, flat with model size: met; manual run, "
                                     "2026-12-01)<!-- /fig -->")
        self.assertNotEqual(edited, README)
        bad = readme_figures.disagreements(edited, readme_figures.expected(DATA))
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("'reshard-memory'", bad[0])
        self.assertIn("54-178 MiB", bad[0])
        # The script's own --check fails on it, and a fill writes the data's text back.
        tmp = tempfile.mkdtemp()
        try:
            path = os.path.join(tmp, "README.md")
            with open(path, "w") as f:
                f.write(edited)
            script = os.path.join(ROOT, "bench/readme_figures.py")
            check = [sys.executable, script, "--readme", path, "--data", DATA, "--check"]
            r = subprocess.run(check, capture_output=True, text=True)
            self.assertEqual(r.returncode, 1, r.stderr)
            self.assertIn("reshard-memory", r.stderr)
            subprocess.run(check[:-1], check=True)
            with open(path) as f:
                self.assertEqual(f.read(), README)
            self.assertEqual(subprocess.run(check).returncode, 0)
        finally:
            shutil.rmtree(tmp)

    def test_a_manual_verdict_is_the_rule_s_not_typed(self):
        with open(os.path.join(DATA, "manual_targets.json")) as f:
            manual = json.load(f)
        goal = dict((n, g) for n, g, _ in readme_figures.MANUAL)["reshard-memory"]
        for t in manual["targets"]:
            if t["goal"] == goal:
                t.update(runs=[900, 2000], verdict="met")
        fig = readme_figures.manual_figures(manual)["reshard-memory"]
        self.assertIn(": tie (within noise);", fig)

    def test_pack_figure_is_the_data_median(self):
        with open(os.path.join(DATA, "pack.json")) as f:
            pack = json.load(f)
        meds = sorted(sorted(r["plan_ms_runs"])[len(r["plan_ms_runs"]) // 2]
                      for r in pack["rows"] if r["method"] == "bragg lpt+swaps"
                      and r["dataset"] in readme_figures.BIG)
        fig = re.search(r"<!-- fig:pack-plan -->in a median ([0-9.]+)(?:-([0-9.]+))? ms", README)
        self.assertIsNotNone(fig, "README's pack figure is not 'in a median X-Y ms'")
        self.assertAlmostEqual(float(fig.group(1)), meds[0], delta=0.051)
        self.assertAlmostEqual(float(fig.group(2) or fig.group(1)), meds[-1], delta=0.051)
        self.assertIn(pack["meta"]["date"], fig.group(0) + README[fig.end():fig.end() + 200])

    def test_a_stale_figure_is_caught(self):
        figs = readme_figures.expected(DATA)
        stale = README.replace(f"<!-- fig:pack-plan -->{figs['pack-plan']}",
                               "<!-- fig:pack-plan -->in 13-17 ms on one core (best of 7)")
        self.assertNotEqual(stale, README)
        bad = readme_figures.disagreements(stale, figs)
        self.assertEqual(len(bad), 1)
        self.assertIn("pack-plan", bad[0])
        self.assertIn("13-17 ms", bad[0])

    def test_a_removed_figure_is_caught(self):
        figs = readme_figures.expected(DATA)
        gone = re.sub(r"<!-- fig:pbox-native -->.*?<!-- /fig -->", "every target met", README)
        bad = readme_figures.disagreements(gone, figs)
        self.assertTrue(any("lacks the figure 'pbox-native'" in b for b in bad), bad)

    def test_an_unknown_figure_is_caught(self):
        bad = readme_figures.disagreements(README + "<!-- fig:made-up -->9x<!-- /fig -->",
                                           readme_figures.expected(DATA))
        self.assertEqual(len(bad), 1, bad)
        self.assertIn("'made-up' is not one bench/readme_figures.py knows", bad[0])

    def test_a_figure_twice_is_caught(self):
        fig = manual_figure("gateway-rate")
        bad = readme_figures.disagreements(README + fig, readme_figures.expected(DATA))
        self.assertEqual(bad, ["README figure 'gateway-rate' appears more than once"])

    def test_a_figure_without_data_is_caught(self):
        tmp = tempfile.mkdtemp()
        try:
            for name in os.listdir(DATA):
                if name not in ("engine.json", "manual_targets.json"):
                    shutil.copy(os.path.join(DATA, name), tmp)
            bad = readme_figures.disagreements(README, readme_figures.expected(tmp))
        finally:
            shutil.rmtree(tmp)
        gone = {n for n in readme_figures.KNOWN if n.startswith("engine")}
        gone |= {n for n, _, _ in readme_figures.MANUAL}
        self.assertEqual(len(bad), len(gone), bad)
        for name in gone:
            self.assertIn(f"README figure {name!r} has no data behind it in docs/data", bad)


class BenchmarksDoc(unittest.TestCase):
    def test_summary_is_what_the_data_gives(self):
        sec = summary.section(summary.rows_from(DATA))
        self.assertIn(sec, DOC, "docs/benchmarks.md's summary is stale: run bench/summary.py")
        self.assertLess(DOC.index(summary.END), DOC.index("\n## pack"),
                        "the summary must open docs/benchmarks.md")

    def test_summary_judges_manual_runs(self):
        with open(os.path.join(DATA, "manual_targets.json")) as f:
            manual = json.load(f)["targets"]
        rows = summary.manual_rows({"targets": manual})
        self.assertEqual(len(rows), len(manual))
        for t, r in zip(manual, rows):
            self.assertTrue(t["date"] and t["command"], t["goal"])
            self.assertIn("manual", r["date"])
        # A hand verdict that contradicts the runs is overridden by the rule.
        wrong = dict(manual[0], runs=[2000], target={"bound": 1024, "better": "lower"},
                     verdict="met")
        self.assertEqual(summary.manual_rows({"targets": [wrong]})[0]["verdict"], "missed")

    def test_missing_engine_data_is_fine(self):
        tmp = tempfile.mkdtemp()
        try:
            for name in ("pack.json", "pbox_bench.json", "manual_targets.json"):
                shutil.copy(os.path.join(DATA, name), tmp)
            parts = {r["part"] for r in summary.rows_from(tmp)}
            self.assertEqual(parts, {"pack", "pbox", "reshard", "gateway"})
        finally:
            shutil.rmtree(tmp)

    def test_every_unregenerated_heading_says_manual(self):
        regions = generated_regions(DOC)
        unlabelled = []
        for m in re.finditer(r"^(#{2,4}) (.*)$", DOC, re.M):
            # A heading whose first line below opens a generated region belongs to it.
            after = DOC[m.end():].lstrip("\n")
            inside = (any(a <= m.start() < b for a, b in regions)
                      or re.match(r"<!-- [a-z-]+:begin", after) is not None)
            if not inside and "manual run" not in m.group(2):
                unlabelled.append(m.group(0))
        self.assertEqual(unlabelled, [], "headings neither regenerated by make bench nor "
                                         "labelled 'manual run, DATE, COMMAND'")

    def test_verdict_words(self):
        for a, b in generated_regions(DOC):
            region = DOC[a:b]
            self.assertNotIn("tie:", region)
            for line in region.splitlines():
                if line.startswith("|") and re.search(r"\btie\b", line):
                    self.assertIn(TIE, line)
        self.assertNotIn("it is met", DOC)


if __name__ == "__main__":
    unittest.main()
