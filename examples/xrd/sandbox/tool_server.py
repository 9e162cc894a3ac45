#!/usr/bin/env python3
"""The xrd task's tool server: a lattice tool and a Bragg's-law tool, one JSON line each way.

Runs inside the sandbox as `python3 /task/tool_server.py`, one process for a whole rollout.
Each stdin line is {"text": "<the model's turn, with its final \\n>"}; each answer is one
stdout line, flushed:

    lattice Al\\n          -> {"observation": "fcc 4.05\\n", "tool": "lattice"}
    bragg 4.05 111 Cu\\n   -> {"observation": "38.47\\n", "tool": "bragg"}
    answer 38.47\\n        -> {"done": true}
    {"verify": ROLLOUT}   -> {"reward": 1, "reason": "..."}   (bragg-rl's
                             task.verifier_in_tool_server: verifier.py's reward, without a
                             process of its own)
    anything else         -> {"observation": "error: <reason>\\n", "tool": "<name|none>",
                              "error": true}

Error texts use only the task vocabulary's characters and are at most 40 characters, since the
model reads them. The server never dies on its input: every line gets exactly one answer (so a
client stays in step), and end of input exits 0.

The physics (the lattice table, the tubes, Bragg's law, the selection rule) lives here too:
verifier.py and ../make_data.py import it, so the tool, the reward and the data cannot drift.
"""

import json
import math
import os
import re
import sys

# Kα1 wavelengths in Å.
TUBES = {"Cu": 1.5406, "Mo": 0.7093, "Co": 1.7890, "Cr": 2.2897, "Fe": 1.9360, "Ag": 0.5594}
STRUCTURES = ("fcc", "bcc", "diamond", "sc")
# The first allowed reflection of each structure: the selection rule the policy must learn.
FIRST_HKL = {"fcc": "111", "diamond": "111", "bcc": "110", "sc": "100"}
HKLS = ("100", "110", "111")
# A turn longer than this is refused unread (a model turn is a few dozen characters).
MAX_LINE_BYTES = 1 << 16

_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)
_SIGNED_NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)


# The table as `--prepare` writes it (bragg-rl's task.setup, once in the prepared sandbox that
# every rollout's sandbox is cloned from): importing ASE (and numpy with it) costs ~0.3 s of CPU
# a process, reading this file ~1 ms, and a rollout starts a tool server and a verifier.
CACHE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lattice.json")


def lattice_table(cache=CACHE):
    """{symbol: (structure, a)} for every element whose ASE reference state is cubic: from
    `cache` when `--prepare` wrote it, else from ASE."""
    if cache and os.path.exists(cache):
        with open(cache, encoding="utf-8") as f:
            return {k: (v[0], float(v[1])) for k, v in json.load(f).items()}
    from ase.data import chemical_symbols, reference_states

    table = {}
    for z, state in enumerate(reference_states):
        if state and state.get("symmetry") in STRUCTURES:
            table[chemical_symbols[z]] = (state["symmetry"], float(state["a"]))
    return table


def format_a(a):
    """The lattice constant as the lattice tool prints it: shortest text that reads back as a."""
    text = "%g" % a
    return text if float(text) == a else repr(a)


def two_theta(a, hkl, tube):
    """2θ in degrees of reflection hkl ("111") of a cubic lattice a (Å) under a tube, or None
    when there is none (λ / 2d > 1)."""
    d = a / math.sqrt(sum(int(c) ** 2 for c in hkl))
    s = TUBES[tube] / (2 * d)
    if s > 1:
        return None
    return math.degrees(2 * math.asin(s))


def format_two_theta(x):
    return "%.2f" % x


def first_peak(table, element, tube):
    """(structure, hkl, 2θ rounded as the bragg tool prints it) of the first peak, or None when
    the element, the tube or the peak does not exist."""
    if element not in table or tube not in TUBES:
        return None
    structure, a = table[element]
    hkl = FIRST_HKL[structure]
    x = two_theta(a, hkl, tube)
    if x is None:
        return None
    return structure, hkl, float(format_two_theta(x))


def parse_number(text, signed=False):
    """A plain decimal number (no exponent, no inf or nan) or None."""
    pattern = _SIGNED_NUMBER if signed else _NUMBER
    return float(text) if pattern.fullmatch(text) else None


def _error(reason, tool="none"):
    text = "error: " + reason
    assert len(text) <= 40, text
    return {"observation": text + "\n", "tool": tool, "error": True}


def _lattice(table, args):
    if len(args) != 1:
        return _error("usage: lattice ELEMENT", "lattice")
    if args[0] not in table:
        return _error("unknown element", "lattice")
    structure, a = table[args[0]]
    return {"observation": "%s %s\n" % (structure, format_a(a)), "tool": "lattice"}


def _bragg(args):
    if len(args) != 3:
        return _error("usage: bragg A HKL TUBE", "bragg")
    a_text, hkl, tube = args
    a = parse_number(a_text, signed=True)
    if a is None or not a > 0 or not math.isfinite(a):
        return _error("a must be a positive number", "bragg")
    if not re.fullmatch(r"[0-9]{3}", hkl, re.ASCII):
        return _error("hkl must be three digits", "bragg")
    if hkl == "000":
        return _error("hkl 000 is no reflection", "bragg")
    if tube not in TUBES:
        return _error("unknown tube", "bragg")
    x = two_theta(a, hkl, tube)
    if x is None:
        return _error("no reflection, lambda above 2d", "bragg")
    return {"observation": format_two_theta(x) + "\n", "tool": "bragg"}


def respond(table, line):
    """The answer (a dict) to one request line (bytes, without its newline)."""
    try:
        request = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return _error("request is not json")
    if isinstance(request, dict) and "verify" in request:
        import verifier  # noqa: PLC0415  (beside this file; it imports this module)

        value, reason = verifier.reward(table, request["verify"])
        return {"reward": value, "reason": reason}
    if not isinstance(request, dict) or not isinstance(request.get("text"), str):
        return _error("request has no text")
    text = request["text"]
    if not text.endswith("\n"):
        return _error("turn does not end with a newline")
    words = text[:-1].split(" ")
    name, args = words[0], words[1:]
    if name == "answer":
        return {"done": True}
    if name == "lattice":
        return _lattice(table, args)
    if name == "bragg":
        return _bragg(args)
    return _error("unknown tool (lattice, bragg)")


def _read_line(stream):
    """(line without its newline, too_long) or None at end of input. A line over
    MAX_LINE_BYTES is read to its end in bounded pieces and dropped."""
    line = stream.readline(MAX_LINE_BYTES + 1)
    if not line:
        return None
    if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
        return line.rstrip(b"\n"), False
    while line and not line.endswith(b"\n"):
        line = stream.readline(MAX_LINE_BYTES)
    return b"", True


def prepare(cache=CACHE):
    """Writes the table from ASE to `cache` (atomically)."""
    table = lattice_table(cache=None)
    tmp = cache + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({k: list(v) for k, v in sorted(table.items())}, f)
    os.replace(tmp, cache)


def main():
    if sys.argv[1:] == ["--prepare"]:
        prepare()
        return 0
    table = lattice_table()
    stdin, stdout = sys.stdin.buffer, sys.stdout
    try:
        while True:
            got = _read_line(stdin)
            if got is None:
                return 0
            line, too_long = got
            reply = _error("turn too long") if too_long else respond(table, line)
            stdout.write(json.dumps(reply) + "\n")
            stdout.flush()
    except (BrokenPipeError, KeyboardInterrupt):
        # The client went away: nothing is left to answer.
        return 0


if __name__ == "__main__":
    sys.exit(main())
