"""pbox-fusion against a real pboxd, driven by SandboxFusion's own PyPI client (sandbox-fusion
0.3.7) and by raw HTTP for what that client cannot send (memory_limit_MB, hostile bodies).

Runs under the Python peer environment (BRAGG_PEER_PYTHON, which has sandbox_fusion). Needs
root (pboxd). The binaries come from $PBOXD, $PBOX_CLI and $PBOX_FUSION (set by ctest).
After every test no sandbox may be left on the agent (`pbox ps -q`).
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator, List

import pytest
import requests

import sandbox_fusion
from sandbox_fusion import RunCodeRequest, RunStatus, CommandRunStatus

PBOXD = os.environ.get("PBOXD", "")
PBOX_CLI = os.environ.get("PBOX_CLI", "")
PBOX_FUSION = os.environ.get("PBOX_FUSION", "")
MAX_REQUEST_MB = 4


class Stack:
    """A pboxd and a pbox-fusion in front of it, in a temp dir of their own."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pfu-", dir="/tmp"))
        self.socket = self.root / "pbox.sock"
        self.endpoint = f"unix://{self.socket}"
        ready = self.root / "ready.json"
        self.agent_log = open(self.root / "pboxd.log", "wb")
        self.agent = subprocess.Popen(
            [PBOXD, "--listen", self.endpoint, "--state-dir", str(self.root / "state"),
             "--ready-file", str(ready), "--max-sandboxes", "64"],
            stdout=self.agent_log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert self.agent.poll() is None, self.log("pboxd.log")
            assert time.monotonic() < deadline, "pboxd not ready in 30 s"
            time.sleep(0.02)
        self.fusion_log = open(self.root / "fusion.log", "wb")
        self.fusion = subprocess.Popen(
            [PBOX_FUSION, "--listen", "127.0.0.1:0", "--endpoint", self.endpoint,
             "--max-concurrency", "8", "--max-request-mb", str(MAX_REQUEST_MB),
             "--max-output-kb", "1024"],
            stdout=subprocess.PIPE, stderr=self.fusion_log, text=True)
        line = self.fusion.stdout.readline()
        assert line.startswith("listening on "), (line, self.log("fusion.log"))
        self.url = line.split()[-1]

    def log(self, name: str) -> str:
        return (self.root / name).read_text(errors="replace")[-4000:]

    def sandboxes(self) -> List[str]:
        r = subprocess.run([PBOX_CLI, "--endpoint", self.endpoint, "ps", "-q"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    def wait_no_sandboxes(self, timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while (left := self.sandboxes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"sandboxes left behind: {left}"

    def stop(self) -> None:
        self.fusion.send_signal(signal.SIGTERM)
        fusion_rc = self.fusion.wait(30)
        self.agent.send_signal(signal.SIGTERM)
        agent_rc = self.agent.wait(30)
        self.agent_log.close()
        self.fusion_log.close()
        assert fusion_rc == 0, self.log("fusion.log")
        assert agent_rc == 0, self.log("pboxd.log")
        shutil.rmtree(self.root, ignore_errors=True)


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


def run(stack: Stack, **kw) -> sandbox_fusion.RunCodeResponse:
    # max_attempts=1: the client retries failures (SandboxError too) with backoff otherwise.
    return sandbox_fusion.run_code(RunCodeRequest(**kw), endpoint=stack.url, max_attempts=1,
                                   client_timeout=60)


def post(stack: Stack, body, **kw) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{stack.url}/run_code", data=data,
                         headers={"Content-Type": "application/json"}, timeout=60, **kw)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_ping(stack: Stack) -> None:
    r = requests.get(f"{stack.url}/v1/ping", timeout=10)
    assert r.status_code == 200 and r.json() == "pong"


def test_python_with_stdin_files_and_fetch(stack: Stack) -> None:
    code = ("import helper, sys\n"
            "data = open('in/data.txt').read()\n"
            "open('out/result.txt', 'w').write(data.upper() + sys.stdin.read())\n"
            "print(helper.twice(21))\n")
    r = run(stack, code="import os; os.makedirs('out', exist_ok=True)\n" + code,
            language="python", stdin="tail",
            files={"in/data.txt": b64(b"hello"), "helper.py": b64(b"def twice(x): return 2*x\n")},
            fetch_files=["out/result.txt", "does/not/exist"])
    assert r.status == RunStatus.Success, r
    assert r.run_result.status == CommandRunStatus.Finished
    assert r.run_result.return_code == 0
    assert r.run_result.stdout == "42\n"
    assert r.compile_result is None
    assert r.run_result.execution_time is not None and r.run_result.execution_time < 10
    # Missing files are skipped, as SandboxFusion does.
    assert base64.b64decode(r.files["out/result.txt"]) == b"HELLOtail"
    assert set(r.files) == {"out/result.txt"}


def test_python_error_is_failed_with_stderr(stack: Stack) -> None:
    r = run(stack, code="raise SystemExit('boom')", language="python")
    assert r.status == RunStatus.Failed
    assert r.run_result.return_code == 1 and "boom" in r.run_result.stderr
    assert sandbox_fusion.summary_run_code_result(
        r, sandbox_fusion.SummaryMapping(RunFailed="RE")) == "RE"


def test_bash(stack: Stack) -> None:
    r = run(stack, code="read x; echo \"got $x\"; echo err >&2; exit 3", language="bash",
            stdin="7\n")
    assert r.status == RunStatus.Failed
    assert (r.run_result.stdout, r.run_result.stderr, r.run_result.return_code) == \
        ("got 7\n", "err\n", 3)


def test_cpp_compiles_and_runs(stack: Stack) -> None:
    code = "#include <iostream>\nint main(){long x; std::cin >> x; std::cout << x * 2 << '\\n';}"
    r = run(stack, code=code, language="cpp", stdin="21")
    assert r.status == RunStatus.Success, r
    assert r.compile_result.status == CommandRunStatus.Finished
    assert r.compile_result.return_code == 0
    assert r.run_result.stdout == "42\n"


def test_cpp_compile_error(stack: Stack) -> None:
    r = run(stack, code="int main( {", language="cpp")
    assert r.status == RunStatus.Failed
    assert r.compile_result.return_code != 0 and "error" in r.compile_result.stderr
    assert r.run_result is None
    assert sandbox_fusion.summary_run_code_result(
        r, sandbox_fusion.SummaryMapping(CompileFailed="CE")) == "CE"


def test_run_timeout(stack: Stack) -> None:
    t0 = time.monotonic()
    r = run(stack, code="import time\nprint('started', flush=True)\ntime.sleep(60)",
            language="python", run_timeout=1)
    assert time.monotonic() - t0 < 5
    assert r.status == RunStatus.Failed
    assert r.run_result.status == CommandRunStatus.TimeLimitExceeded
    assert r.run_result.return_code is None
    assert r.run_result.stdout == "started\n"
    assert 0.9 < r.run_result.execution_time < 3


def test_memory_bomb_under_memory_limit(stack: Stack) -> None:
    # The PyPI client's model has no memory_limit_MB; verl sends it as raw JSON, as here.
    t0 = time.monotonic()
    r = post(stack, {"code": "x = []\nwhile True: x.append(bytearray(10**7))",
                     "language": "python", "memory_limit_MB": 128, "run_timeout": 20})
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "Failed", body
    assert body["run_result"]["status"] == "Finished"
    assert body["run_result"]["return_code"] == -9  # the OOM killer's SIGKILL, as Popen says
    assert time.monotonic() - t0 < 10


def test_fork_bomb_is_contained(stack: Stack) -> None:
    t0 = time.monotonic()
    r = run(stack, code="import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
            language="python", run_timeout=2)
    assert r.status == RunStatus.Failed
    assert r.run_result.status == CommandRunStatus.TimeLimitExceeded
    assert time.monotonic() - t0 < 15
    ok = run(stack, code="print('alive')", language="python")
    assert ok.run_result.stdout == "alive\n"


def test_huge_output_is_capped(stack: Stack) -> None:
    t0 = time.monotonic()
    r = run(stack, code="import sys\nfor _ in range(100): sys.stdout.write('x' * (1 << 20))",
            language="python")
    assert r.status == RunStatus.Success
    out = r.run_result.stdout
    assert len(out) <= (1 << 20) + 200 and "bytes dropped" in out
    assert out.startswith("xxxx") and out.endswith("xxxx")
    assert time.monotonic() - t0 < 10


def test_verl_shaped_payload(stack: Stack) -> None:
    # verl/utils/reward_score/sandbox_fusion/utils.py call_sandbox_api's body and headers.
    payload = json.dumps({"compile_timeout": 10, "run_timeout": 10, "code": "print(input())",
                          "stdin": "3", "memory_limit_MB": 1024, "language": "python",
                          "files": {}, "fetch_files": []})
    r = requests.post(f"{stack.url}/run_code", data=payload, timeout=30,
                      headers={"Content-Type": "application/json", "Accept": "application/json"})
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "3\n"
    assert set(body) >= {"status", "message", "compile_result", "run_result", "files"}


@pytest.mark.parametrize("body,field", [
    ("this is not json", None),
    ({"code": "1"}, "language"),
    ({"language": "python"}, "code"),
    ({"code": "1", "language": "cobol"}, "language"),
    ({"code": "1", "language": "go"}, "language"),  # SandboxFusion's, no toolchain here
    ({"code": "1", "language": "python", "run_timeout": -1}, "run_timeout"),
    ({"code": "1", "language": "python", "compile_timeout": 0}, "compile_timeout"),
    ({"code": "1", "language": "python", "files": {"../../etc/x": "aGk="}}, "files"),
    ({"code": "1", "language": "python", "files": {"/etc/x": "aGk="}}, "files"),
    ({"code": "1", "language": "python", "files": {"a": "not base64!"}}, "files"),
    ({"code": "1", "language": "python", "fetch_files": ["../../../etc/shadow"]}, "fetch_files"),
    ({"code": "1", "language": "python", "fetch_files": ["/etc/shadow"]}, "fetch_files"),
])
def test_hostile_requests_refused_422(stack: Stack, body, field) -> None:
    r = post(stack, body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail[0]["loc"][0] == "body"
    if field is not None:
        assert detail[0]["loc"][1] == field, detail


def test_hostile_huge_base64_and_wrong_routes(stack: Stack) -> None:
    big = b64(os.urandom((MAX_REQUEST_MB << 20) + 1024))
    r = post(stack, {"code": "1", "language": "python", "files": {"big.bin": big}})
    assert r.status_code == 413, r.status_code
    assert "max-request-mb" in r.json()["detail"]
    assert requests.get(f"{stack.url}/run_code", timeout=10).status_code in (404, 405)
    assert requests.post(f"{stack.url}/nope", timeout=10).status_code == 404
    # Just under the cap is served.
    r = post(stack, {"code": "1", "language": "python",
                     "files": {"a.bin": b64(b"\0" * (2 << 20))}})
    assert r.status_code == 200 and r.json()["status"] == "Success"
    # The server still serves.
    assert run(stack, code="print(1)", language="python").run_result.stdout == "1\n"


def test_sixteen_concurrent_calls(stack: Stack) -> None:
    def one(i: int):
        return i, run(stack, code=f"import sys; print({i} * int(sys.stdin.read()))",
                      language="python", stdin="3")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    for i, r in results:
        assert r.status == RunStatus.Success, r
        assert r.run_result.stdout == f"{3 * i}\n"
    assert stack.sandboxes() == []


def test_async_client(stack: Stack) -> None:
    import asyncio

    async def main():
        reqs = [RunCodeRequest(code=f"echo {i}", language="bash") for i in range(4)]
        return await asyncio.gather(*(sandbox_fusion.run_code_async(
            q, endpoint=stack.url, max_attempts=1) for q in reqs))

    for i, r in enumerate(asyncio.run(main())):
        assert r.status == RunStatus.Success and r.run_result.stdout == f"{i}\n"


def _hang_up_mid_call(stack: Stack, code: str) -> None:
    body = json.dumps({"code": code, "language": "python", "run_timeout": 60}).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 10
        while not stack.sandboxes():
            assert time.monotonic() < deadline, "the call never got a sandbox"
            time.sleep(0.05)


def test_client_disconnect_destroys_the_sandbox(stack: Stack) -> None:
    t0 = time.monotonic()
    _hang_up_mid_call(stack, "import time; time.sleep(60)")
    stack.wait_no_sandboxes(timeout=2.0)
    assert time.monotonic() - t0 < 5
    assert run(stack, code="print(2)", language="python").run_result.stdout == "2\n"


def test_queued_callers_that_hang_up_never_get_a_sandbox(stack: Stack) -> None:
    # 8 slots held by sleepers, more callers queued behind them; everyone hangs up.
    body = json.dumps({"code": "import time; time.sleep(60)", "language": "python",
                       "run_timeout": 60}).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    socks = []
    for _ in range(12):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /run_code HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        socks.append(s)
    deadline = time.monotonic() + 15
    while len(stack.sandboxes()) < 8:
        assert time.monotonic() < deadline, "8 calls never ran"
        time.sleep(0.05)
    assert len(stack.sandboxes()) == 8  # --max-concurrency 8: the other 4 wait
    for s in socks:
        s.close()
    stack.wait_no_sandboxes(timeout=3.0)
    assert run(stack, code="print(3)", language="python").run_result.stdout == "3\n"
