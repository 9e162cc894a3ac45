"""bragg_rl.plots on synthetic metrics files: the PNGs, the summary's numbers (time to target
included, reached and never reached), event lines, a truncated last line, missing keys, compare
mode, the CLI, and files that are not metrics files.

Run by ctest (rl_plots_test) under Debian's /usr/bin/python3 with PYTHONPATH=<build>/python.
"""

import json
import os
import subprocess
import sys

import pytest

from bragg_rl import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 8 * 1024  # an empty 110-dpi figure is under this; axes, curves and text are not


def step_line(step, reward, t=None, **extra):
    line = {
        "step": step,
        "version": step + 1,
        "time_s": 10.0 * (step + 1) if t is None else t,
        "reward_mean": reward,
        "success_rate": min(1.0, reward / 2),
        "samples": 16,
        "over_stale": 0,
        "dropped_stale": step % 2,
        "staleness": {"0": 10, "1": 4, "2": 2},
        "gen_tokens_per_s": 1000.0 + step,
        "train_tokens_per_s": 3000.0,
        "cache_hit_rate": 0.5,
        "tool_ms_p50": 3.0,
        "tool_ms_p99": 20.0,
        "sandbox_failures": 0,
        "time_split": {"generate_s": 6.0, "tools_s": 1.0, "verify_s": 0.25, "train_s": 2.0,
                       "sync_s": 0.5, "wait_s": 0.5},
        "loss": 0.1,
        "kl": 0.01,
        "entropy": 1.0,
        "logprob_diff_max": 0.02,
        "engine_idle_fraction": 0.1,
    }
    line.update(extra)
    return line


def write_run(directory, lines, tail=""):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
        f.write(tail)
    return str(directory)


def check_png(path):
    assert os.path.isfile(path), path
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > MIN_PNG_BYTES, (path, len(data))
    return len(data)


# rewards 0.1 .. 0.9 in steps of 0.1; the trailing 3-step mean first reaches 0.6 at step 6
# ((0.5 + 0.6 + 0.7) / 3 = 0.6), at time_s 70.
REWARDS = [0.1 * (i + 1) for i in range(9)]


@pytest.fixture
def async_run(tmp_path):
    lines = [{"event": "warm_start", "version": 0}]
    for i, r in enumerate(REWARDS):
        extra = {"eval_success": 0.2 * i} if i % 4 == 0 else {}
        lines.append(step_line(i, r, **extra))
    lines.append({"event": "end", "steps": len(REWARDS)})
    return write_run(tmp_path / "async", lines)


def test_summary_numbers(async_run):
    s = plots.summary(async_run, target=0.6)
    assert s["steps"] == 9 and s["last_step"] == 8
    assert s["wall_s"] == pytest.approx(90.0)
    assert s["final_reward"] == pytest.approx((0.7 + 0.8 + 0.9) / 3)
    assert s["final_success"] == pytest.approx((0.35 + 0.4 + 0.45) / 3)
    assert s["time_to_target_s"] == pytest.approx(70.0)
    assert s["step_to_target"] == 6
    assert s["over_stale"] == 0
    assert s["dropped_stale"] == 4  # steps 1, 3, 5, 7
    assert s["samples"] == 9 * 16
    assert s["staleness"] == {0: 90, 1: 36, 2: 18}
    assert s["staleness_mean"] == pytest.approx((36 + 2 * 18) / 144)
    assert s["time_split_s"]["generate_s"] == pytest.approx(54.0)
    assert s["time_split_s"]["verify_s"] == pytest.approx(9 * 0.25)
    assert s["last_eval_success"] == pytest.approx(1.6)  # step 8
    assert s["best_eval_success"] == pytest.approx(1.6)
    assert s["events"] == ["warm_start", "end"]
    assert s["truncated_last_line"] is False


def test_time_to_target_needs_a_full_window_and_a_mean_not_a_single_step(tmp_path):
    # A lucky step at 1.0 does not reach 0.6: the 3-step means are 1/3, 1/3 and 1.7/3.
    run = write_run(tmp_path / "spike", [step_line(0, 0.0), step_line(1, 0.0), step_line(2, 1.0),
                                         step_line(3, 0.0), step_line(4, 0.7)])
    s = plots.summary(run, target=0.6)
    assert s["time_to_target_s"] is None and s["step_to_target"] is None
    # Two steps above target: no full window yet.
    run = write_run(tmp_path / "short", [step_line(0, 1.0), step_line(1, 1.0)])
    assert plots.summary(run, target=0.5)["time_to_target_s"] is None
    # Exactly the target counts as reached, and it is the wall-clock of that step, not step*10.
    run = write_run(tmp_path / "exact", [step_line(0, 0.5, t=3.0), step_line(1, 0.5, t=4.5),
                                         step_line(2, 0.5, t=7.25)])
    s = plots.summary(run, target=0.5)
    assert s["time_to_target_s"] == pytest.approx(7.25) and s["step_to_target"] == 2


def test_never_reached_and_no_target(async_run):
    s = plots.summary(async_run, target=5.0)
    assert s["time_to_target_s"] is None and s["step_to_target"] is None
    assert "not reached" in plots.format_summary(s)
    s = plots.summary(async_run)
    assert s["target"] is None and s["time_to_target_s"] is None


def test_plots_written_and_not_trivial(async_run, tmp_path):
    out = tmp_path / "out"
    paths = plots.write_plots([plots.load_run(async_run)], ["async"], str(out), target=0.6)
    assert sorted(os.path.basename(p) for p in paths) == [
        "reward.png", "staleness.png", "time_split.png"]
    for p in paths:
        check_png(p)


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    run = write_run(tmp_path / "killed", [step_line(0, 0.2), step_line(1, 0.4)],
                    tail='{"step": 2, "version": 3, "time_s": 30.0, "rew')
    with pytest.warns(RuntimeWarning, match="truncated last line"):
        loaded = plots.load_run(run)
    assert [s["step"] for s in loaded.steps] == [0, 1]
    assert loaded.truncated_last_line
    with pytest.warns(RuntimeWarning):
        s = plots.summary(run)
    assert s["steps"] == 2 and s["final_reward"] == pytest.approx(0.3)
    assert s["truncated_last_line"] is True


def test_a_bad_line_inside_the_file_is_an_error(tmp_path):
    run = write_run(tmp_path / "bad", [step_line(0, 0.2)],
                    tail='not json\n' + json.dumps(step_line(1, 0.3)) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not JSON"):
        plots.load_run(run)
    run = write_run(tmp_path / "list", [[1, 2, 3]])
    with pytest.raises(ValueError, match="must be a JSON object"):
        plots.load_run(run)
    run = write_run(tmp_path / "nostep", [{"reward_mean": 1.0}])
    with pytest.raises(ValueError, match='integer "step"'):
        plots.load_run(run)
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        plots.load_run(str(tmp_path / "nowhere"))


def test_empty_file(tmp_path):
    run = write_run(tmp_path / "empty", [])
    s = plots.summary(run, target=0.5)
    assert s["steps"] == 0 and s["last_step"] is None and s["final_reward"] is None
    assert s["time_to_target_s"] is None and s["staleness"] == {}
    assert "steps 0" in plots.format_summary(s)
    for p in plots.write_plots([plots.load_run(run)], ["empty"], str(tmp_path / "out")):
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC


def test_only_events(tmp_path):
    run = write_run(tmp_path / "ev", [{"event": "warm_start"}, {"event": "end"}])
    s = plots.summary(run)
    assert s["steps"] == 0 and s["events"] == ["warm_start", "end"]


def test_steps_missing_optional_keys(tmp_path):
    lines = [{"step": 0, "time_s": 1.0, "reward_mean": 0.1},
             {"step": 1, "reward_mean": 0.2, "success_rate": 0.0},  # no time_s
             {"step": 2, "time_s": 3.0, "reward_mean": None, "staleness": {"0": 3}},
             {"step": 3, "time_s": 4.0, "reward_mean": 0.4,
              "time_split": {"train_s": 1.0}}]
    run = write_run(tmp_path / "sparse", lines)
    s = plots.summary(run, target=0.1)
    assert s["steps"] == 4
    assert s["final_reward"] == pytest.approx(0.3)  # null ignored: (0.2 + 0.4) / 2
    assert s["final_success"] == pytest.approx(0.0)
    assert s["staleness"] == {0: 3}
    assert s["time_split_s"]["train_s"] == pytest.approx(1.0)
    assert s["time_split_s"]["verify_s"] == 0.0  # records from before verify_s had none
    assert s["over_stale"] == 0 and s["gen_tokens_per_s"] is None
    assert s["time_to_target_s"] is None  # every window holds the null reward or is not full
    for p in plots.write_plots([plots.load_run(run)], ["sparse"], str(tmp_path / "out")):
        check_png(p)


def test_over_stale_is_reported(tmp_path):
    run = write_run(tmp_path / "os", [step_line(0, 0.1, over_stale=2), step_line(1, 0.1)])
    s = plots.summary(run)
    assert s["over_stale"] == 2
    assert "must be 0" in plots.format_summary(s)


def test_compare_draws_both_runs(async_run, tmp_path):
    sync = write_run(tmp_path / "sync", [step_line(i, 0.05 * (i + 1), t=25.0 * (i + 1),
                                                   staleness={"0": 16})
                                         for i in range(9)])
    runs = [plots.load_run(async_run), plots.load_run(sync)]
    single = plots.write_plots(runs[:1], ["async"], str(tmp_path / "one"), target=0.6)
    both = plots.write_plots(runs, ["async", "sync"], str(tmp_path / "two"), target=0.6)
    for p_one, p_two in zip(single, both):
        # Same figure with a second run's curves, bars or panel on it: a bigger PNG.
        assert check_png(p_two) > check_png(p_one), p_two
    with pytest.raises(ValueError, match="2 runs but 1 labels"):
        plots.write_plots(runs, ["async"], str(tmp_path / "x"))


def test_many_steps_are_binned(tmp_path):
    assert plots._bin_size(60) == 1 and plots._bin_size(61) == 10
    assert plots._bin_size(600) == 10 and plots._bin_size(1200) == 20
    run = write_run(tmp_path / "long", [step_line(i, 0.001 * i, t=4.0 * i) for i in range(250)])
    check_png(plots.plot_time_split([plots.load_run(run)], ["long"],
                                    str(tmp_path / "time_split.png")))


def run_cli(*args):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "bragg_rl.plots", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_compare_and_summary(async_run, tmp_path):
    sync = write_run(tmp_path / "sync", [step_line(i, 0.05 * (i + 1), t=25.0 * (i + 1))
                                         for i in range(9)])
    out = tmp_path / "cli-out"
    r = run_cli(async_run, "--compare", sync, "--labels", "async,sync", "--target", "0.6",
                "--out", str(out), "--summary")
    assert r.returncode == 0, r.stderr
    for name in ("reward.png", "staleness.png", "time_split.png"):
        check_png(str(out / name))
    assert "async (" in r.stdout and "sync (" in r.stdout
    assert "time to reward 0.6: 70.0 s (step 6)" in r.stdout
    assert "time to reward 0.6: not reached" in r.stdout  # sync tops out at 0.4


def test_cli_defaults_to_the_run_dir_and_reports_errors(async_run, tmp_path):
    r = run_cli(async_run)
    assert r.returncode == 0, r.stderr
    check_png(os.path.join(async_run, "reward.png"))
    r = run_cli(str(tmp_path / "missing"))
    assert r.returncode == 2 and "no metrics.jsonl" in r.stderr
    r = run_cli(async_run, "--labels", "a,b")
    assert r.returncode == 2 and "--labels needs 1" in r.stderr


def test_cli_warns_on_a_truncated_line(tmp_path):
    run = write_run(tmp_path / "killed", [step_line(0, 0.2)], tail='{"step": 1, "ver')
    r = run_cli(run, "--summary")
    assert r.returncode == 0, r.stderr
    assert "truncated last line" in r.stderr
    assert "steps 1" in r.stdout and "a truncated last line was skipped" in r.stdout
