#!/usr/bin/env python3
"""The xrd task's reward: prints 1 or 0 for one finished rollout.

Reads one JSON object on stdin:
    {"prompt": "Al Cu\\n", "meta": {...}, "turns": ["lattice Al\\n", ...],
     "observations": ["fcc 4.05\\n", ...]}
and prints 1 when the number in the last turn that starts with "answer " is within 0.01 of the
first diffraction peak's 2θ (as the bragg tool prints it, 2 decimals), else 0. The truth is
recomputed from the prompt's element and tube; meta is not trusted. Anything malformed (the
input, the prompt, the answer) is a 0 with the reason on stderr, never a crash.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tool_server  # noqa: E402  (beside this file, in /task inside the sandbox)

TOLERANCE = 0.01


def reward(table, rollout):
    """(0 or 1, reason)."""
    if not isinstance(rollout, dict):
        return 0, "input is not a JSON object"
    prompt, turns = rollout.get("prompt"), rollout.get("turns")
    if not isinstance(prompt, str) or not isinstance(turns, list):
        return 0, "input lacks a string prompt or a list of turns"
    words = prompt[:-1].split(" ") if prompt.endswith("\n") else []
    if len(words) != 2:
        return 0, "prompt is not 'ELEMENT TUBE\\n': %r" % prompt[:80]
    peak = tool_server.first_peak(table, words[0], words[1])
    if peak is None:
        return 0, "prompt %r names no known element, tube and peak" % prompt[:80]
    answers = [t for t in turns if isinstance(t, str) and t.startswith("answer ")]
    if not answers:
        return 0, "no answer turn"
    text = answers[-1][len("answer "):]
    if text.endswith("\n"):
        text = text[:-1]
    value = tool_server.parse_number(text, signed=True)
    if value is None:
        return 0, "answer %r is not a number" % text[:80]
    # The margin, far below the answers' precision, keeps float rounding (38.48 - 38.47 is
    # 0.0100000000000051) from failing an answer exactly 0.01 away.
    error = abs(value - peak[2])
    if error > TOLERANCE + 1e-9:
        return 0, "answer %s is off by %.4f" % (text, error)
    return 1, "answer %s within %.2f of %.2f" % (text, TOLERANCE, peak[2])


def main():
    try:
        rollout = json.loads(sys.stdin.read())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        print("verifier: input is not JSON: %s" % e, file=sys.stderr)
        print(0)
        return 0
    value, reason = reward(tool_server.lattice_table(), rollout)
    print("verifier: %s" % reason, file=sys.stderr)
    print(value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
