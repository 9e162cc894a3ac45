"""pbox.parse_size against the size vectors the agent's ParseSize is tested with (no agent)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import pbox

VECTORS = json.loads((Path(__file__).resolve().parents[2] / "data" / "sizes.json").read_text())[
    "vectors"
]


def test_the_table_is_there() -> None:
    assert len(VECTORS) > 50
    assert any(v == "error" for v in VECTORS.values())


@pytest.mark.parametrize("text,expected", sorted(VECTORS.items()))
def test_vector(text: str, expected: object) -> None:
    if expected == "error":
        with pytest.raises(ValueError, match="cannot parse size"):
            pbox.parse_size(text)
    else:
        assert pbox.parse_size(text) == expected


def test_floats_round_like_strings() -> None:
    for number in (0.4, 0.5, 1.5, 2.5, 1023.5):
        assert pbox.parse_size(number) == pbox.parse_size(repr(number))
    for bad in (-0.5, math.inf, math.nan, 1e19):
        with pytest.raises(ValueError):
            pbox.parse_size(bad)
