"""The one verdict rule of every generated benchmark table (docs/benchmarks.md).

A target is a bound and a direction: lower is better (plan time <= 20 ms) or higher is better
(throughput >= 1.5 GB/s), optionally on a ratio against a peer measured in the same run
(create no worse than runsc: ours / peer <= 1; round trip 100x better than podman:
peer / ours >= 100). Each side brings its runs, one value per run (a run's p50, a run's
planning time). The verdict looks at the whole spread of the runs, never at one summary:

  - met: every run is on the right side of the bound (for a ratio, even the least favourable
    pairing, our worst run against the peer's best, clears it);
  - missed: every run is on the wrong side (even our best run against the peer's worst);
  - tie (within noise): otherwise, the runs' spread straddles the bound. For a "no worse than
    the peer" target (ratio bound 1) this is exactly "the two sides' min..max overlap".

A tie is never printed as met. Stdlib only, for Debian's /usr/bin/python3.

    from verdict import Target, verdict, RULE
    verdict(Target(20.0, "lower"), [16.1, 20.1, 18.0])            -> "tie (within noise)"
    verdict(Target(1.0, "lower", ratio="ours/peer"), ours, peer)  -> "met" | ...
"""

import statistics
from dataclasses import dataclass

MET = "met"
MISSED = "missed"
TIE = "tie (within noise)"
VERDICTS = (MET, MISSED, TIE)

RULE = ("Verdicts (bench/verdict.py, one rule for every table): met when every run is on the "
        "right side of the target (for a ratio against a peer, even our worst run against the "
        "peer's best), missed when every run is on the wrong side, otherwise "
        "\"tie (within noise)\": the runs' spread straddles the target; a tie is never counted "
        "as met.")


@dataclass(frozen=True)
class Target:
    """bound: the number to meet. better: "lower" (value <= bound meets) or "higher"
    (value >= bound meets). ratio: None for an absolute value; "ours/peer" or "peer/ours" for
    a ratio of our runs against a peer's runs."""
    bound: float
    better: str
    ratio: str = None

    def __post_init__(self):
        if self.better not in ("lower", "higher"):
            raise ValueError(f"better must be 'lower' or 'higher', not {self.better!r}")
        if self.ratio not in (None, "ours/peer", "peer/ours"):
            raise ValueError(f"ratio must be None, 'ours/peer' or 'peer/ours', not {self.ratio!r}")


def _values(name, runs):
    vals = [float(v) for v in runs if v is not None]
    if not vals:
        raise ValueError(f"{name}: no runs to judge")
    return vals


def spread(target, ours, peer=None):
    """(lowest, median, highest) of the judged quantity over the runs. For a ratio: the median
    is the ratio of the medians, the ends the most extreme pairings of the two sides' runs."""
    ours = _values("ours", ours)
    if target.ratio is None:
        if peer is not None:
            raise ValueError("a peer's runs were given for a target that is not a ratio")
        return min(ours), statistics.median(ours), max(ours)
    peer = _values("peer", peer if peer is not None else [])
    num, den = (ours, peer) if target.ratio == "ours/peer" else (peer, ours)
    if min(den) <= 0:
        raise ValueError("a ratio's denominator runs must be positive")
    return (min(num) / max(den), statistics.median(num) / statistics.median(den),
            max(num) / min(den))


def verdict(target, ours, peer=None):
    """"met", "missed" or "tie (within noise)" for runs `ours` (and `peer`'s, for a ratio)
    against `target`. Raises ValueError on empty runs or a malformed target."""
    lo, _, hi = spread(target, ours, peer)
    if target.better == "lower":
        best, worst = lo, hi
        if worst <= target.bound:
            return MET
        if best > target.bound:
            return MISSED
    else:
        best, worst = hi, lo
        if worst >= target.bound:
            return MET
        if best < target.bound:
            return MISSED
    return TIE


def shown(v):
    """A verdict as a table cell: a miss in bold, the others as they are."""
    return f"**{v}**" if v == MISSED else v
