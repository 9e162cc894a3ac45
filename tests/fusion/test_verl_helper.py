"""pbox-fusion against a real pboxd, driven by verl's own SandboxFusion reward helper
(verl.utils.reward_score.sandbox_fusion, verl as python/peers.lock pins it), called as verl's
reward code calls it.

verl is imported through its package on the peer environment's torch with no GPU visible
(CUDA_VISIBLE_DEVICES is emptied before the import). Every verdict asserted here (True, False,
-1 api/sandbox error, -2 runtime error, -3 timeout, -4 compile error, and the status strings of
the metadata) is verl's parsing of pbox-fusion's answers, so it checks their shape.

Runs under the Python peer environment (BRAGG_PEER_PYTHON). Needs root (pboxd). The binaries
come from $PBOXD, $PBOX_CLI and $PBOX_FUSION (set by ctest). After every test no sandbox may be
left on the agent (`pbox ps -q`).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

# Before torch is imported (by verl): the check is that the helper imports without a GPU.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch  # noqa: E402

import verl  # noqa: E402
from verl.utils.reward_score import default_compute_score  # noqa: E402
from verl.utils.reward_score.sandbox_fusion.utils import (  # noqa: E402
    call_sandbox_api, check_correctness)

from test_fusion import PBOX_CLI, PBOX_FUSION, PBOXD, Stack  # noqa: E402

PEERS_LOCK = Path(__file__).resolve().parents[2] / "python" / "peers.lock"

# One program for the stdin/stdout cases: doubles its input, hangs on 0, raises on a negative.
DOUBLE = """import sys, time
n = int(sys.stdin.read())
if n == 0:
    time.sleep(60)
if n < 0:
    raise ValueError("negative input")
print(n * 2)
"""

CPP_DOUBLE = ("#include <iostream>\n"
              "int main(){long x; std::cin >> x; std::cout << x * 2 << '\\n';}\n")


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    if os.geteuid() != 0:
        pytest.skip("pboxd needs root (namespaces, mounts, cgroups)")
    for path in (PBOXD, PBOX_CLI, PBOX_FUSION):
        if not path or not os.access(path, os.X_OK):
            pytest.skip(f"binary not found: set PBOXD, PBOX_CLI, PBOX_FUSION ({path!r})")
    s = Stack()
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def nothing_left(stack: Stack) -> Iterator[None]:
    yield
    stack.wait_no_sandboxes()
    assert stack.fusion.poll() is None, stack.log("fusion.log")


def url(stack: Stack) -> str:
    # verl's sandbox_fusion_url is the whole endpoint ("https://<your service endpoint>/run_code").
    return f"{stack.url}/run_code"


def test_verl_imports_without_a_gpu() -> None:
    pinned = [line.split("==")[1] for line in PEERS_LOCK.read_text().splitlines()
              if line.startswith("verl==")]
    assert pinned == [verl.__version__], (pinned, verl.__version__)
    assert not torch.cuda.is_available()
    assert "site-packages/verl/" in check_correctness.__code__.co_filename


def test_call_sandbox_api(stack: Stack) -> None:
    resp, err = call_sandbox_api(url(stack), code="print(input()[::-1])", stdin="verl",
                                 compile_timeout=10, run_timeout=10, memory_limit_mb=1024,
                                 language="python")
    assert err is None, err
    assert resp["status"] == "Success", resp
    assert resp["compile_result"] is None
    assert resp["run_result"]["stdout"] == "lrev\n"
    assert resp["run_result"]["return_code"] == 0
    # A case without input: verl sends "stdin": null.
    resp, err = call_sandbox_api(url(stack), code="print(7)", stdin=None, compile_timeout=10,
                                 run_timeout=10, memory_limit_mb=1024, language="python")
    assert err is None and resp["run_result"]["stdout"] == "7\n", (err, resp)


def test_check_correctness_python_cases(stack: Stack) -> None:
    t0 = time.monotonic()
    results, meta = check_correctness(
        url(stack), {"inputs": ["21", "5", "0", "-1"], "outputs": ["42", "11", "0", "0"]},
        DOUBLE, timeout=2)
    assert time.monotonic() - t0 < 20
    assert results == [True, False, -3, -2], meta
    assert [m["status"] for m in meta] == ["success", "wrong_answer", "timeout", "runtime_error"]
    assert all(m["api_request_error"] is None for m in meta)
    assert [m["api_status"] for m in meta] == ["Success", "Success", "Failed", "Failed"]
    assert [m["run_status"] for m in meta] == ["Finished", "Finished", "TimeLimitExceeded",
                                               "Finished"]
    assert [m["exit_code"] for m in meta] == [0, 0, None, 1]
    assert [m["stdout"] for m in meta] == ["42\n", "10\n", "", ""]
    assert "ValueError: negative input" in meta[3]["stderr"]
    assert all(m["compile_status"] is None for m in meta)  # python: no compile step
    assert 1.5 < meta[2]["duration"] < 5, meta[2]
    assert all(0 <= m["duration"] < 5 for m in meta)


def test_check_correctness_cpp(stack: Stack) -> None:
    results, meta = check_correctness(
        url(stack), {"inputs": ["21", "4"], "outputs": ["42", "9"]}, CPP_DOUBLE,
        language="cpp", timeout=20)
    assert results == [True, False], meta
    assert [m["status"] for m in meta] == ["success", "wrong_answer"]
    assert all(m["compile_status"] == "Finished" for m in meta)
    assert [m["stdout"] for m in meta] == ["42\n", "8\n"]

    results, meta = check_correctness(
        url(stack), {"inputs": ["1", "2"], "outputs": ["2", "4"]}, "int main( {\n",
        language="cpp", timeout=20)
    assert results == [-4, -4], meta
    assert [m["status"] for m in meta] == ["compile_error", "compile_error"]
    assert all(m["compile_duration"] < 20 for m in meta)
    assert meta[0]["api_status"] == "Failed"
    assert meta[0]["compile_status"] == "Finished"
    assert "error" in meta[0]["compile_stderr"]
    assert meta[0]["run_status"] is None


def test_memory_limit_is_a_runtime_error(stack: Stack) -> None:
    results, meta = check_correctness(
        url(stack), {"inputs": [""], "outputs": [""]},
        "x = []\nwhile True: x.append(bytearray(10**7))", timeout=20, memory_limit_mb=128)
    assert results == [-2], meta
    assert meta[0]["status"] == "runtime_error"
    assert meta[0]["exit_code"] == -9  # the OOM killer's SIGKILL


def test_function_call_cases(stack: Stack) -> None:
    # fn_name: verl wraps the code in its own driver and passes JSON lines on stdin.
    results, meta = check_correctness(
        url(stack), {"fn_name": "add", "inputs": ["1\n2", "[1]\n[2, 3]", "1\n1"],
                     "outputs": ["3", "[1, 2, 3]", "3"]},
        "def add(a, b):\n    return a + b\n", timeout=10)
    assert results == [True, True, False], meta
    assert meta[2]["stdout"] == "2\n"


def test_compute_score_as_verl_training_calls_it(stack: Stack) -> None:
    # verl/trainer/ppo/reward.py load_reward_manager: default_compute_score with the URL, a
    # multiprocessing.Manager semaphore of reward.sandbox_fusion.max_concurrent and
    # memory_limit_mb; check_correctness fans the cases out on its own thread pool.
    manager = multiprocessing.Manager()
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, len(stack.sandboxes()))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        score = functools.partial(default_compute_score, sandbox_fusion_url=url(stack),
                                  concurrent_semaphore=manager.Semaphore(4),
                                  memory_limit_mb=1024)
        solution = ("Squares:\n```python\nimport time\nn = int(input())\ntime.sleep(0.5)\n"
                    "print(n * n)\n```\n")
        outputs = [str(i * i) for i in range(12)]
        outputs[9] = "80"  # one wrong among the first ten, which continuous=True scores
        got = score("codecontests", solution,
                    json.dumps({"inputs": [str(i) for i in range(12)], "outputs": outputs}))
    finally:
        done.set()
        watcher.join()
        manager.shutdown()
    assert got == pytest.approx(0.9)
    # Calls ran side by side, never more than verl's semaphore lets through.
    assert 2 <= peak <= 4, peak


def test_language_it_does_not_run_is_an_api_error(stack: Stack) -> None:
    t0 = time.monotonic()
    results, meta = check_correctness(url(stack), {"inputs": [""], "outputs": [""]},
                                      "fn main() {}", language="rust")
    assert results == [-1], meta
    assert meta[0]["status"] == "api_error"
    assert "422" in meta[0]["api_request_error"]
    assert time.monotonic() - t0 < 5  # a 422 is not retried (verl retries 504 only)


def test_sandbox_error_when_pboxd_is_gone(stack: Stack) -> None:
    # A stack of its own whose pboxd is stopped: pbox-fusion answers SandboxError.
    own = Stack()
    try:
        own.agent.send_signal(signal.SIGTERM)
        assert own.agent.wait(30) == 0, own.log("pboxd.log")
        results, meta = check_correctness(url(own), {"inputs": ["1"], "outputs": ["2"]},
                                          DOUBLE, timeout=5)
        assert results == [-1], meta
        assert meta[0]["status"] == "sandbox_error"
        assert meta[0]["api_status"] == "SandboxError"
        assert meta[0]["api_response"]["message"], meta[0]
        assert own.fusion.poll() is None, own.log("fusion.log")
    finally:
        own.fusion.send_signal(signal.SIGTERM)
        fusion_rc = own.fusion.wait(30)
        if own.agent.poll() is None:
            own.agent.kill()
            own.agent.wait(30)
        own.agent_log.close()
        own.fusion_log.close()
    assert fusion_rc == 0, own.log("fusion.log")
    shutil.rmtree(own.root, ignore_errors=True)
