"""grpc.health.v1.Health, as Kubernetes' grpc probes and grpc_health_probe call it: served by
gRPC's own implementation in pboxd, on every endpoint, without a token (a kubelet has none);
SERVING for "" and the Pbox service, NOT_FOUND for any other name, NOT_SERVING as soon as a stop
signal arrives (a Watch sees the change before the agent exits)."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

TOKEN = "health-token-0123456789abcdef"

# grpc.health.v1 messages on the wire. HealthCheckRequest: field 1, string `service`.
# HealthCheckResponse: field 1, enum `status` (UNKNOWN 0, SERVING 1, NOT_SERVING 2). Encoded
# here by hand: neither Debian's python3-grpcio nor the peer environment ships grpc_health.
SERVING, NOT_SERVING = 1, 2


def _request(service: str) -> bytes:
    name = service.encode()
    assert len(name) < 128
    return (b"\x0a" + bytes([len(name)]) + name) if name else b""


def _status(response: bytes) -> int:
    if response == b"":
        return 0  # proto3: UNKNOWN is the default, sent as nothing
    assert response[0] == 0x08 and len(response) == 2, response
    return response[1]


def _channel(endpoint: str) -> grpc.Channel:
    target = endpoint if endpoint.startswith("unix://") else endpoint[len("tcp://"):]
    return grpc.insecure_channel(target)


def _check(channel: grpc.Channel, service: str) -> int:
    call = channel.unary_unary("/grpc.health.v1.Health/Check")
    return _status(call(_request(service), timeout=10))


@pytest.fixture
def tcp_agent(make_agent):
    return make_agent(tcp_token=TOKEN)


def test_serving_on_every_endpoint_without_a_token(tcp_agent) -> None:
    for endpoint in tcp_agent.endpoints:
        with _channel(endpoint) as ch:
            assert _check(ch, "") == SERVING, endpoint
            assert _check(ch, "bragg.pbox.v1.Pbox") == SERVING, endpoint


def test_unknown_service_is_not_found(tcp_agent) -> None:
    with _channel(tcp_agent.tcp_endpoint) as ch:
        for name in ("bragg.pbox.v1.Nope", "grpc.health.v1.Health", "x" * 100):
            with pytest.raises(grpc.RpcError) as err:
                _check(ch, name)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND, name


def test_health_needs_no_token_but_the_api_still_does(tcp_agent) -> None:
    import pbox

    with _channel(tcp_agent.tcp_endpoint) as ch:
        assert _check(ch, "") == SERVING
    with pbox.Client(tcp_agent.tcp_endpoint, token=None) as c:
        with pytest.raises(pbox.Unauthenticated):
            c.list()


def test_watch_sees_not_serving_when_the_agent_stops(make_agent) -> None:
    agent = make_agent()
    with agent.client() as c:
        c.create()  # the agent has a sandbox to destroy when it stops
        with _channel(agent.endpoint) as ch:
            watch = ch.unary_stream("/grpc.health.v1.Health/Watch")
            stream = watch(_request("bragg.pbox.v1.Pbox"), timeout=60)
            seen = [_status(next(stream))]
            assert seen == [SERVING]
            stopper = threading.Thread(target=lambda: agent.proc.send_signal(signal.SIGTERM))
            stopper.start()
            try:
                for response in stream:
                    seen.append(_status(response))
                    if seen[-1] != SERVING:
                        break
            except grpc.RpcError as e:
                # The server went away before sending the change: that is the bug this checks.
                pytest.fail(f"Watch ended with {e.code()} after {seen}, no NOT_SERVING")
            finally:
                stopper.join()
            assert seen[-1] == NOT_SERVING, seen
    assert agent.proc.wait(30) == 0
