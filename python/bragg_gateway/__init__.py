"""Python client for rollouts through bragg-gateway, with delta router replay.

Each turn of a rollout asks only for the routed experts of the new suffix
(``routed_experts_start_len`` = positions already held) and appends them to the client-side
array, which stays bit-identical to asking for the whole array ([tokens - 1, layers, top_k]
int32, little-endian, base64 in ``meta_info.routed_experts``). Standard library only.
Not thread-safe: one client per thread.
"""

import array
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


class RolloutClient:
    def __init__(self, base_url, return_routed_experts=False, delta=True, timeout=600.0):
        if not base_url.startswith("http://"):
            raise ValueError(f"base_url must be http://HOST:PORT, got {base_url!r}")
        self._url = base_url.rstrip("/")
        self._experts = return_routed_experts
        self._delta = delta
        self._timeout = timeout
        self._arrays = {}  # rollout id -> (positions, array('i'))

    def generate(self, rollout_id, input_ids, sampling_params=None):
        """One turn: POST /generate. Returns the response dict; meta_info.routed_experts is
        replaced by the byte count received (``routed_experts_bytes``)."""
        body = {"input_ids": list(input_ids), "routing_key": rollout_id,
                "sampling_params": sampling_params or {}}
        positions, held = self._arrays.get(rollout_id, (0, array.array("i")))
        start = 0
        if self._experts:
            body["return_routed_experts"] = True
            if self._delta:
                if positions > len(input_ids):
                    raise ValueError(f"rollout {rollout_id}: input_ids ({len(input_ids)}) is "
                                     f"shorter than what it already covered ({positions})")
                start = positions
                body["routed_experts_start_len"] = start
        req = urllib.request.Request(self._url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as r:
                res = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise GatewayError(f"POST /generate: HTTP {e.code}: {e.read()[:500]!r}", e.code)
        except (urllib.error.URLError, OSError) as e:
            raise GatewayError(f"POST /generate: {e}")
        meta = res.get("meta_info")
        if not isinstance(meta, dict) or not isinstance(res.get("output_ids"), list):
            raise GatewayError("response has no meta_info/output_ids")
        if self._experts:
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
            if not self._delta:
                held = array.array("i")
                positions = 0
            # layers * top_k ids per position, the same on every turn of a rollout.
            if count and positions and len(held) // positions != len(suffix) // count:
                raise GatewayError(f"routed experts width changed from {len(held) // positions} "
                                   f"to {len(suffix) // count} ids per position")
            held.extend(suffix)
            self._arrays[rollout_id] = (total - 1, held)
        return res

    def routed_experts(self, rollout_id):
        """The rollout's full routed-experts array so far (array('i'), flattened)."""
        return self._arrays.get(rollout_id, (0, array.array("i")))[1]

    def forget(self, rollout_id):
        """Ends a finished rollout: drops its array and tells the gateway
        (POST /rollouts/forget), which stops counting it as load. The local state is dropped
        even when the call fails (GatewayError)."""
        self._arrays.pop(rollout_id, None)
        req = urllib.request.Request(self._url + "/rollouts/forget",
                                     data=json.dumps({"routing_key": rollout_id}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self._timeout) as r:
                r.read()
        except urllib.error.HTTPError as e:
            raise GatewayError(f"POST /rollouts/forget: HTTP {e.code}: {e.read()[:500]!r}",
                               e.code)
        except (urllib.error.URLError, OSError) as e:
            raise GatewayError(f"POST /rollouts/forget: {e}")
