"""An agent started with a low soft limit on open files (1024 is the usual default; here 256)
still holds many more sandboxes than that limit allows fds for (each holds about three in the
agent), and its sandboxes get the limit the agent started with, not the raised one."""

from __future__ import annotations

import resource
from concurrent.futures import ThreadPoolExecutor

from runtime_under_test import AGENT_ARGS, RUNTIME

SOFT = 256
SANDBOXES = 120  # ~360 agent fds: past SOFT


def test_agent_outgrows_a_low_soft_nofile_limit(make_agent) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4 * SOFT:
        import pytest
        pytest.skip(f"hard limit on open files is only {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (SOFT, hard))
    try:
        agent = make_agent(extra=["--max-sandboxes", str(SANDBOXES + 4)] + AGENT_ARGS)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with open(f"/proc/{agent.pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    assert int(line.split()[3]) == hard, line
    with agent.client() as c, ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: c.create(runtime=RUNTIME, memory="64M", disk="16M"),
                             range(SANDBOXES)))
        r = made[-1].run(["sh", "-c", "ulimit -n"])
        assert r.ok and r.stdout.strip() == str(SOFT).encode(), r
        list(pool.map(lambda sb: sb.destroy(), made))
        assert c.info().live_sandboxes == 0
