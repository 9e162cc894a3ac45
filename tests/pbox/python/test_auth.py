"""Auth beyond test_tcp.py: every refused TCP caller gets the same status and the same message
(no token, a wrong one, another agent's, a malformed header), the message names no sandbox,
session or label, and the unix socket refuses a user outside its group."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

import pbox
from pbox._proto import pbox_pb2 as pb
from pbox._proto import pbox_pb2_grpc as pb_grpc

TOKEN_A = "auth-token-a-0123456789abcdef"
TOKEN_B = "auth-token-b-fedcba9876543210"


@pytest.fixture
def agents(make_agent):
    return make_agent(tcp_token=TOKEN_A), make_agent(tcp_token=TOKEN_B)


def _calls(stub, sandbox_id: str, session_id: str):
    """Unary calls and the first message of streaming calls, each naming real ids."""
    yield "Info", lambda md: stub.Info(pb.InfoRequest(), metadata=md, timeout=10)
    yield "Health", lambda md: stub.Health(pb.HealthRequest(), metadata=md, timeout=10)
    yield "Session", lambda md: list(stub.Session(iter([pb.SessionRequest(
        open=pb.SessionOpen(client_name="intruder"))]), metadata=md, timeout=10))
    yield "Run", lambda md: stub.Run(pb.RunRequest(sandbox_id=sandbox_id, argv=["true"]),
                                     metadata=md, timeout=10)
    yield "Stat", lambda md: stub.Stat(pb.StatRequest(sandbox_id=sandbox_id, path="/tmp/secret"),
                                       metadata=md, timeout=10)
    yield "ListDir", lambda md: stub.ListDir(pb.ListDirRequest(sandbox_id=sandbox_id, path="/"),
                                             metadata=md, timeout=10)
    yield "ListSandboxes", lambda md: stub.ListSandboxes(pb.ListSandboxesRequest(), metadata=md,
                                                         timeout=10)
    yield "GetSandbox", lambda md: stub.GetSandbox(pb.GetSandboxRequest(sandbox_id=sandbox_id),
                                                   metadata=md, timeout=10)
    yield "CreateSandbox", lambda md: stub.CreateSandbox(
        pb.CreateSandboxRequest(session_id=session_id), metadata=md, timeout=10)
    yield "DestroySandbox", lambda md: stub.DestroySandbox(
        pb.DestroySandboxRequest(sandbox_id=sandbox_id), metadata=md, timeout=10)
    yield "Exec", lambda md: list(stub.Exec(iter([pb.ExecRequest(start=pb.ExecStart(
        sandbox_id=sandbox_id, argv=["cat", "/tmp/secret"]))]), metadata=md, timeout=10))
    yield "ReadFile", lambda md: list(stub.ReadFile(
        pb.ReadFileRequest(sandbox_id=sandbox_id, path="/tmp/secret"), metadata=md, timeout=10))


def test_refusals_are_identical_and_name_nothing(agents) -> None:
    a, _ = agents
    with a.client() as owner, owner.session(client_name="secret-client") as session:
        sb = session.create(labels={"owner": "secret-label"})
        sb.write_file("/tmp/secret", b"s3cret")
        target = a.tcp_endpoint[len("tcp://"):]
        bad_metadata = {
            "no token": (),
            "wrong token": (("authorization", "Bearer wrong-token-0123456789"),),
            "other agent's token": (("authorization", f"Bearer {TOKEN_B}"),),
            "token with a suffix": (("authorization", f"Bearer {TOKEN_A}x"),),
            "token prefix": (("authorization", f"Bearer {TOKEN_A[:-1]}"),),
            "no Bearer": (("authorization", TOKEN_A),),
            "lower-case bearer": (("authorization", f"bearer {TOKEN_A}"),),
            "token in another header": (("x-token", TOKEN_A),),
            "empty bearer": (("authorization", "Bearer "),),
            "4 KiB token": (("authorization", "Bearer " + "A" * 4096),),
        }
        seen = {}
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.PboxStub(channel)
            for label, md in bad_metadata.items():
                # A real sandbox and session, and ids that do not exist: the refusal must not
                # tell them apart.
                for ids in ((sb.id, session.id), ("sb-0000000000000000", "ss-00000000")):
                    for method, call in _calls(stub, *ids):
                        with pytest.raises(grpc.RpcError) as err:
                            call(md)
                        seen[(label, ids[0], method)] = (err.value.code(), err.value.details())
        outcomes = set(seen.values())
        assert outcomes == {(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")}, seen
        for _, details in outcomes:
            for secret in (sb.id, session.id, "secret-client", "secret-label", "s3cret"):
                assert secret not in details
        # Nothing changed behind the refusals.
        assert [x.id for x in owner.list()] == [sb.id]
        assert sb.read_file("/tmp/secret") == b"s3cret"
        # The right token still works on the same endpoint.
        with pbox.Client(a.tcp_endpoint, token=TOKEN_A) as c:
            assert [x.id for x in c.list()] == [sb.id]


def test_unix_socket_refuses_other_users(make_agent) -> None:
    a = make_agent()
    mode = os.stat(a.socket).st_mode & 0o777
    assert mode & 0o007 == 0, f"socket mode {mode:o} lets everyone in"
    assert mode == 0o660
    assert os.stat(a.state_dir).st_mode & 0o077 == 0
    # Open the directory so that only the socket's own mode stands between nobody and it.
    os.chmod(a.root, 0o755)
    probe = ("import socket, sys\n"
             "s = socket.socket(socket.AF_UNIX)\n"
             "try:\n"
             "    s.connect(sys.argv[1])\n"
             "    print('connected')\n"
             "except PermissionError:\n"
             "    print('EACCES')\n")

    def as_nobody() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    r = subprocess.run([sys.executable, "-c", probe, str(a.socket)], preexec_fn=as_nobody,
                       capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "EACCES", (r.stdout, r.stderr)
    with a.client() as c:  # root still gets in
        assert c.health().serving
