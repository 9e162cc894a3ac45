"""Python client for rollouts through bragg-gateway, with delta router replay.

Each turn of a rollout asks only for the routed experts of the new suffix
(``routed_experts_start_len`` = positions already held) and appends them to the client-side
array, which stays bit-identical to asking for the whole array ([tokens - 1, layers, top_k]
int32, little-endian, base64 in ``meta_info.routed_experts``).

``RolloutClient`` (standard library only; not thread-safe: one client per thread) and
``AsyncRolloutClient`` (asyncio, on aiohttp: ``pip install bragg[async]``; one per event loop,
any number of rollouts at once) share the bookkeeping. Both stream (``generate_stream``: SGLang's
SSE events as dicts, the last one the whole answer) and send an API key (the gateway's
``--api-key``) as ``Authorization: Bearer``.
"""

import array
import asyncio
import base64
import json
import sys
import urllib.error
import urllib.request


class GatewayError(Exception):
    """A transport failure or a non-200 answer; ``status`` is the HTTP status or None."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class _Rollouts:
    """Per-rollout routed-experts arrays: the request body of a turn and the bookkeeping of
    its answer, for both clients."""

    def __init__(self, return_routed_experts, delta):
        self.experts = return_routed_experts
        self.delta = delta
        self.arrays = {}  # rollout id -> (positions, array('i'))

    def body(self, rollout_id, input_ids, sampling_params, stream):
        """The /generate body and the position the answer's routed experts start at."""
        body = {"input_ids": list(input_ids), "routing_key": rollout_id,
                "sampling_params": sampling_params or {}}
        if stream:
            body["stream"] = True
        start = 0
        if self.experts:
            body["return_routed_experts"] = True
            if self.delta:
                positions = self.arrays.get(rollout_id, (0, None))[0]
                if positions > len(input_ids):
                    raise ValueError(f"rollout {rollout_id}: input_ids ({len(input_ids)}) is "
                                     f"shorter than what it already covered ({positions})")
                start = positions
                body["routed_experts_start_len"] = start
        return body, start

    def finish(self, rollout_id, input_ids, start, res):
        """Checks a whole answer and folds its routed experts into the rollout's array;
        meta_info.routed_experts is replaced by the byte count received
        (``routed_experts_bytes``)."""
        meta = res.get("meta_info") if isinstance(res, dict) else None
        if not isinstance(meta, dict) or not isinstance(res.get("output_ids"), list):
            raise GatewayError("response has no meta_info/output_ids")
        if not self.experts:
            return res
        positions, held = self.arrays.get(rollout_id, (0, array.array("i")))
        b64 = meta.pop("routed_experts", None)
        if not isinstance(b64, str):
            raise GatewayError("asked for routed_experts but the response has none")
        meta["routed_experts_bytes"] = len(b64)
        suffix = array.array("i")
        suffix.frombytes(base64.b64decode(b64, validate=True))
        if sys.byteorder != "little":
            suffix.byteswap()
        total = len(input_ids) + len(res["output_ids"])
        count = total - 1 - start
        if count < 0 or (count == 0 and len(suffix)) or (count and len(suffix) % count):
            raise GatewayError(f"routed experts of {len(suffix)} ids do not fit "
                               f"{count} new positions")
        if not self.delta:
            held = array.array("i")
            positions = 0
        # layers * top_k ids per position, the same on every turn of a rollout.
        if count and positions and len(held) // positions != len(suffix) // count:
            raise GatewayError(f"routed experts width changed from {len(held) // positions} "
                               f"to {len(suffix) // count} ids per position")
        held.extend(suffix)
        self.arrays[rollout_id] = (total - 1, held)
        return res

    def routed_experts(self, rollout_id):
        return self.arrays.get(rollout_id, (0, array.array("i")))[1]


def _check_url(base_url):
    if not base_url.startswith("http://"):
        raise ValueError(f"base_url must be http://HOST:PORT, got {base_url!r}")
    return base_url.rstrip("/")


def _headers(api_key):
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def _sse_event(line):
    """The JSON of one SSE ``data:`` line; None for other lines and for ``[DONE]``."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    data = line[5:].strip()
    if data == b"[DONE]":
        return None
    try:
        event = json.loads(data)
    except ValueError:
        raise GatewayError(f"stream event is not JSON: {data[:200]!r}")
    if isinstance(event, dict) and "error" in event and "output_ids" not in event:
        raise GatewayError(f"stream ended with an error: {event['error']}")
    return event


class RolloutClient:
    def __init__(self, base_url, return_routed_experts=False, delta=True, timeout=600.0,
                 api_key=None):
        self._url = _check_url(base_url)
        self._state = _Rollouts(return_routed_experts, delta)
        self._timeout = timeout
        self._headers = _headers(api_key)

    def _post(self, path, body):
        req = urllib.request.Request(self._url + path, data=json.dumps(body).encode(),
                                     headers=self._headers)
        try:
            return urllib.request.urlopen(req, timeout=self._timeout)
        except urllib.error.HTTPError as e:
            raise GatewayError(f"POST {path}: HTTP {e.code}: {e.read()[:500]!r}", e.code)
        except (urllib.error.URLError, OSError) as e:
            raise GatewayError(f"POST {path}: {e}")

    def generate(self, rollout_id, input_ids, sampling_params=None):
        """One turn: POST /generate. Returns the response dict; meta_info.routed_experts is
        replaced by the byte count received (``routed_experts_bytes``)."""
        body, start = self._state.body(rollout_id, input_ids, sampling_params, stream=False)
        try:
            with self._post("/generate", body) as r:
                res = json.loads(r.read())
        except (OSError, ValueError) as e:
            raise GatewayError(f"POST /generate: {e}")
        return self._state.finish(rollout_id, input_ids, start, res)

    def generate_stream(self, rollout_id, input_ids, sampling_params=None):
        """One turn, streamed: yields SGLang's events (dicts) as the worker sends them; the
        last is the whole answer, checked and folded in as generate() does. A stream that ends
        without one raises GatewayError."""
        body, start = self._state.body(rollout_id, input_ids, sampling_params, stream=True)
        last = None
        try:
            with self._post("/generate", body) as r:
                for line in r:
                    event = _sse_event(line)
                    if event is None:
                        continue
                    if last is not None:
                        yield last
                    last = event
        except OSError as e:
            raise GatewayError(f"POST /generate (stream): {e}")
        if last is None:
            raise GatewayError("the stream ended without an answer")
        yield self._state.finish(rollout_id, input_ids, start, last)

    def routed_experts(self, rollout_id):
        """The rollout's full routed-experts array so far (array('i'), flattened)."""
        return self._state.routed_experts(rollout_id)

    def forget(self, rollout_id):
        """Ends a finished rollout: drops its array and tells the gateway
        (POST /rollouts/forget), which stops counting it as load. The local state is dropped
        even when the call fails (GatewayError)."""
        self._state.arrays.pop(rollout_id, None)
        try:
            with self._post("/rollouts/forget", {"routing_key": rollout_id}) as r:
                r.read()
        except OSError as e:
            raise GatewayError(f"POST /rollouts/forget: {e}")


class AsyncRolloutClient:
    """RolloutClient for asyncio, on aiohttp (imported when the client is made; ``pip install
    bragg[async]``). One pooled session: use ``async with`` or ``await close()``. Turns of one
    rollout must not overlap (each turn extends the last); different rollouts run at once.

        async with AsyncRolloutClient("http://gateway:8000") as c:
            res = await c.generate("r1", ids, {"max_new_tokens": 64})
            async for event in c.generate_stream("r2", ids):
                ...
    """

    def __init__(self, base_url, return_routed_experts=False, delta=True, timeout=600.0,
                 api_key=None, max_connections=0):
        import aiohttp  # here, so that a missing aiohttp fails now, not at the first call
        self._aiohttp = aiohttp
        self._url = _check_url(base_url)
        self._state = _Rollouts(return_routed_experts, delta)
        self._timeout = timeout
        self._headers = _headers(api_key)
        self._max_connections = max_connections
        self._session = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def close(self):
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self):
        aiohttp = self._aiohttp
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout),
                connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self._session

    async def _post(self, path, body, handle):
        try:
            async with self._http().post(self._url + path, json=body,
                                         headers=self._headers) as r:
                if r.status != 200:
                    raise GatewayError(f"POST {path}: HTTP {r.status}: "
                                       f"{(await r.read())[:500]!r}", r.status)
                return await handle(r)
        except asyncio.TimeoutError:  # before OSError, which it is on Python 3.11+
            raise GatewayError(f"POST {path}: no answer within {self._timeout} s")
        except (self._aiohttp.ClientError, OSError, ValueError) as e:
            raise GatewayError(f"POST {path}: {e}")

    async def generate(self, rollout_id, input_ids, sampling_params=None):
        """One turn: as RolloutClient.generate."""
        body, start = self._state.body(rollout_id, input_ids, sampling_params, stream=False)

        async def read(r):
            return json.loads(await r.read())
        res = await self._post("/generate", body, read)
        return self._state.finish(rollout_id, input_ids, start, res)

    async def generate_stream(self, rollout_id, input_ids, sampling_params=None):
        """One turn, streamed: as RolloutClient.generate_stream, an async iterator."""
        body, start = self._state.body(rollout_id, input_ids, sampling_params, stream=True)
        last = None
        try:
            async with self._http().post(self._url + "/generate", json=body,
                                         headers=self._headers) as r:
                if r.status != 200:
                    raise GatewayError(f"POST /generate: HTTP {r.status}: "
                                       f"{(await r.read())[:500]!r}", r.status)
                async for line in r.content:
                    event = _sse_event(line)
                    if event is None:
                        continue
                    if last is not None:
                        yield last
                    last = event
        except asyncio.TimeoutError:
            raise GatewayError(f"POST /generate (stream): not done within {self._timeout} s")
        except (self._aiohttp.ClientError, OSError) as e:
            raise GatewayError(f"POST /generate (stream): {e}")
        if last is None:
            raise GatewayError("the stream ended without an answer")
        yield self._state.finish(rollout_id, input_ids, start, last)

    def routed_experts(self, rollout_id):
        return self._state.routed_experts(rollout_id)

    async def forget(self, rollout_id):
        """As RolloutClient.forget."""
        self._state.arrays.pop(rollout_id, None)

        async def drain(r):
            await r.read()
        await self._post("/rollouts/forget", {"routing_key": rollout_id}, drain)
