"""Which runtime the hardening tests (isolation, leaks, overload) exercise.

    PBOX_TEST_RUNTIME    runtime name passed to every create (default "native")
    PBOX_TEST_AGENT_ARGS extra pboxd flags for that runtime (shell words, default none)

so that the same probes run on another runtime with e.g.
    PBOX_TEST_RUNTIME=gvisor PBOX_TEST_AGENT_ARGS="--runtime gvisor" pytest tests/pbox/python/...
"""

from __future__ import annotations

import os
import shlex
from typing import List

RUNTIME: str = os.environ.get("PBOX_TEST_RUNTIME", "native")
AGENT_ARGS: List[str] = shlex.split(os.environ.get("PBOX_TEST_AGENT_ARGS", ""))


def percentile(values: List[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]
