"""pbox.cluster: endpoints (file, list, $PBOX_ENDPOINTS), CPU split, and ClusterClient against two
agents on two TCP ports with different tokens: least-loaded and named placement, one session
spanning both, a dead or full node passed over, hostile endpoint files and CPU lists."""

from __future__ import annotations

import json
import os

import pytest

import pbox
from pbox.cluster import format_cpu_list, split_cpus

TOKEN_A = "cluster-token-a-0123456789abcdef"
TOKEN_B = "cluster-token-b-fedcba9876543210"


# ---- CPU lists and the split (no agent needed) ----

def test_cpu_lists_round_trip_and_reject_junk() -> None:
    assert pbox.parse_cpu_list("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert pbox.parse_cpu_list("5,1,1-2") == [1, 2, 5]
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    for bad in ("", " ", "a", "1-", "-1", "3-1", "1,,2", "1-2-3", "0x3", "1.5", "99999"):
        with pytest.raises(ValueError):
            pbox.parse_cpu_list(bad)
    with pytest.raises(ValueError):
        format_cpu_list([])


def test_split_takes_the_last_n_or_a_list() -> None:
    s = split_cpus("0-63", 8)
    assert (s.trainer, s.sandbox) == ("0-55", "56-63")
    s = split_cpus("2,4,6,8", "2")
    assert (s.trainer, s.sandbox) == ("2,4", "6,8")
    s = split_cpus([0, 1, 2, 3], "0,3")
    assert (s.trainer, s.sandbox) == ("1-2", "0,3")
    assert s.role("trainer") == "1-2" and s.role("sandbox") == "0,3"
    with pytest.raises(ValueError):
        s.role("gpu")
    for bad in (0, -1, 4, 5, "4", "0-3", "4-5", "x", True):
        with pytest.raises(ValueError):
            split_cpus("0-3", bad)


def test_cpu_split_from_endpoints_file_env_and_affinity(tmp_path, monkeypatch) -> None:
    ep = tmp_path / "endpoints.json"
    ep.write_text(json.dumps({"nodes": [
        {"node": "n1", "endpoint": "tcp://127.0.0.1:1", "cpuset": "6-7", "trainer_cpus": "0-5"},
        {"node": "n2", "endpoint": "tcp://127.0.0.1:2", "cpuset": "3", "trainer_cpus": "0-2"}]}))
    monkeypatch.setenv("PBOX_ENDPOINTS", str(ep))
    monkeypatch.delenv("PBOX_SANDBOX_CPUS", raising=False)
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    assert pbox.cpu_split() == pbox.CpuSplit(trainer="0-2", sandbox="3", node="n2")
    assert pbox.cpu_split(node="n1").trainer == "0-5"
    monkeypatch.setenv("SLURMD_NODENAME", "elsewhere")
    with pytest.raises(ValueError, match="no entry for node"):
        pbox.cpu_split()
    monkeypatch.setenv("PBOX_SANDBOX_CPUS", "1")
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) >= 2:
        s = pbox.cpu_split()
        assert s.sandbox == str(mine[-1])
        assert pbox.parse_cpu_list(s.trainer) == mine[:-1]
    assert pbox.cpu_split(2, available="0-9").sandbox == "8-9"


# ---- endpoints ----

def test_load_endpoints_forms(tmp_path, monkeypatch) -> None:
    eps = pbox.load_endpoints("tcp://127.0.0.1:7000, tcp://127.0.0.1:7001")
    assert [e.endpoint for e in eps] == ["tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001"]
    assert pbox.load_endpoints(["unix:///tmp/a.sock"])[0].node == "unix:///tmp/a.sock"
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"token_file": "/t", "nodes": [
        {"node": "a", "host": "127.0.0.1", "port": 7000},
        {"node": "b", "endpoint": "tcp://127.0.0.1:7001", "token_file": "/u"}]}))
    eps = pbox.load_endpoints(str(f))
    assert [(e.node, e.endpoint, e.token_file) for e in eps] == [
        ("a", "tcp://127.0.0.1:7000", "/t"), ("b", "tcp://127.0.0.1:7001", "/u")]
    monkeypatch.setenv("PBOX_ENDPOINTS", str(f))
    assert [e.node for e in pbox.load_endpoints()] == ["a", "b"]
    monkeypatch.delenv("PBOX_ENDPOINTS")
    with pytest.raises(ValueError, match="no endpoints"):
        pbox.load_endpoints()


@pytest.mark.parametrize("content", [
    "", "not json", "[]", "{}", '{"nodes": []}', '{"nodes": "x"}', '{"nodes": [1]}',
    '{"nodes": [{"node": "a"}]}', '{"nodes": [{"host": "h", "port": 0}]}',
    '{"nodes": [{"host": "h", "port": "80"}]}', '{"nodes": [{"host": "h", "port": 70000}]}',
    '{"nodes": [{"endpoint": "http://x:1"}]}', '{"nodes": [{"endpoint": 5}]}',
    '{"nodes": [{"endpoint": "tcp://h:1", "cpuset": "zz"}]}',
    '{"nodes": [{"endpoint": "tcp://h:1", "token_file": 3}]}',
    '{"nodes": [{"node": "a", "endpoint": "tcp://h:1"}, {"node": "a", "endpoint": "tcp://h:2"}]}',
])
def test_bad_endpoints_files_are_value_errors(tmp_path, content) -> None:
    f = tmp_path / "e.json"
    f.write_text(content)
    with pytest.raises(ValueError):
        pbox.ClusterClient(endpoints_file=str(f))


def test_bad_endpoint_lists(tmp_path) -> None:
    for bad in ("", ",", "tcp://nohost", "ftp://x:1", "tcp://a:1,tcp://a:1", ["tcp://h:x"]):
        with pytest.raises(ValueError):
            pbox.ClusterClient(bad)
    with pytest.raises(ValueError):
        pbox.ClusterClient(endpoints_file=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError):
        pbox.ClusterClient("tcp://127.0.0.1:1", endpoints_file=str(tmp_path / "x"))
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"nodes": [{"endpoint": "tcp://127.0.0.1:1",
                                        "token_file": str(tmp_path / "no-token")}]}))
    with pytest.raises(ValueError, match="token file"):
        pbox.ClusterClient(endpoints_file=str(f))


# ---- against two agents ----

@pytest.fixture
def two(make_agent, tmp_path):
    a = make_agent(tcp_token=TOKEN_A, extra=["--cpus", "0", "--max-sandboxes", "8"])
    b = make_agent(tcp_token=TOKEN_B, extra=["--cpus", "0", "--max-sandboxes", "8"])
    f = tmp_path / "endpoints.json"
    f.write_text(json.dumps({"job_id": "42", "nodes": [
        {"node": "na", "endpoint": a.tcp_endpoint, "token_file": str(a.token_file),
         "cpuset": "0"},
        {"node": "nb", "endpoint": b.tcp_endpoint, "token_file": str(b.token_file),
         "cpuset": "0"}]}))
    return a, b, f


def test_least_loaded_placement_and_one_session(two) -> None:
    a, b, f = two
    with pbox.ClusterClient(endpoints_file=str(f), refresh=60) as cl:
        assert cl.nodes == ["na", "nb"]
        with a.client() as ca:
            pre = ca.create()  # load on na before the session
        cl.wait_healthy(10)  # takes in the agents' counts
        with cl.session(client_name="t", job_id="42") as s:
            assert set(s.ids) == {"na", "nb"} and all(s.ids.values())
            sbs = [s.create(memory="128M", disk="16M") for _ in range(5)]
            nodes = [sb.node for sb in sbs]
            # na holds 1 already: nb, then alternate, ties to the earlier node.
            assert nodes == ["nb", "na", "nb", "na", "nb"], nodes
            listed = s.list()
            assert sorted(x.id for x in listed["na"]) == sorted(
                sb.id for sb in sbs if sb.node == "na")
            assert len(listed["nb"]) == 3
            near = s.create(node="na")
            assert near.node == "na"
            assert near.run("echo near").stdout == b"near\n"
            with pytest.raises(ValueError, match="unknown node"):
                s.create(node="nc")
            for sb in sbs:
                assert sb.run(["cat", "/proc/self/status"]).ok
        # Closing the one session destroyed its sandboxes on both agents, and nothing else.
        left = cl.list()
        assert [x.id for x in left["na"]] == [pre.id] and left["nb"] == []
        h = cl.health()
        assert h["na"].live_sandboxes == 1 and h["nb"].live_sandboxes == 0
        cl.client("na").destroy(pre.id)


def test_placement_counts_agent_reports(two) -> None:
    a, b, f = two
    with b.client() as cb, pbox.ClusterClient(endpoints_file=str(f), refresh=0) as cl:
        others = [cb.create() for _ in range(3)]  # someone else loads nb
        with cl.session() as s:
            assert [s.create().node for _ in range(3)] == ["na", "na", "na"]
            assert s.create().node in ("na", "nb")
        for o in others:
            cb.destroy(o.id)


def test_full_or_dead_node_is_passed_over(make_agent, tmp_path) -> None:
    a = make_agent(tcp_token=TOKEN_A, extra=["--cpus", "0", "--max-sandboxes", "1"])
    b = make_agent(tcp_token=TOKEN_B, extra=["--cpus", "0", "--max-sandboxes", "8"])
    f = tmp_path / "e.json"
    f.write_text(json.dumps({"nodes": [
        {"node": "na", "endpoint": a.tcp_endpoint, "token_file": str(a.token_file)},
        {"node": "nb", "endpoint": b.tcp_endpoint, "token_file": str(b.token_file)}]}))
    with pbox.ClusterClient(endpoints_file=str(f), refresh=60) as cl:
        s = cl.session()
        x = [s.create(memory="128M") for _ in range(4)]
        assert sorted(sb.node for sb in x) == ["na", "nb", "nb", "nb"]
        with pytest.raises(pbox.ResourceExhausted):
            s.create(node="na")  # named: no fallback
        s.close()
    # Wrong token on one node: Unauthenticated is not silently skipped.
    f.write_text(json.dumps({"nodes": [
        {"node": "na", "endpoint": a.tcp_endpoint, "token_file": str(b.token_file)},
        {"node": "nb", "endpoint": b.tcp_endpoint, "token_file": str(b.token_file)}]}))
    with pbox.ClusterClient(endpoints_file=str(f)) as cl:
        with pytest.raises(pbox.Unauthenticated):
            cl.session()
        assert isinstance(cl.health()["na"], pbox.Unauthenticated)
    a.kill()
    f.write_text(json.dumps({"nodes": [
        {"node": "na", "endpoint": a.tcp_endpoint, "token_file": str(a.token_file)},
        {"node": "nb", "endpoint": b.tcp_endpoint, "token_file": str(b.token_file)}]}))
    with pbox.ClusterClient(endpoints_file=str(f), timeout=5) as cl:
        assert isinstance(cl.health()["na"], pbox.Unavailable)
        made = [cl.create(memory="128M") for _ in range(2)]
        assert [m.node for m in made] == ["nb", "nb"]
        for m in made:
            m.destroy()
        with pytest.raises(pbox.Unavailable):
            cl.session()  # a session must span every node


def test_pbox_endpoints_env_list_with_shared_token(make_agent, monkeypatch) -> None:
    a = make_agent(tcp_token=TOKEN_A)
    b = make_agent(tcp_token=TOKEN_A)
    monkeypatch.setenv("PBOX_ENDPOINTS", f"{a.tcp_endpoint},{b.tcp_endpoint}")
    monkeypatch.setenv("PBOX_TOKEN", TOKEN_A)
    with pbox.ClusterClient() as cl:
        assert cl.nodes == [a.tcp_endpoint, b.tcp_endpoint]
        with cl.session() as s:
            got = {s.create().node for _ in range(2)}
            assert got == set(cl.nodes)
    monkeypatch.delenv("PBOX_TOKEN")
    with pbox.ClusterClient(token=TOKEN_B) as cl:
        with pytest.raises(pbox.Unauthenticated):
            cl.create()  # every node refuses: the error is not swallowed
