#!/usr/bin/python3
"""Tool execution: a short pure-Python loop (no numpy).

Enumerates the Miller indices of a cubic lattice, their d-spacings and Bragg angles, and the
allowed reflections of an FCC lattice: the kind of small loop an agent writes inline.
Deterministic for a given seed.

    python3 pyloop.py SEED
"""
import json
import math
import sys


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    a = 3.6 + 0.01 * (seed % 50)
    wavelength = 1.5406
    reflections = {}
    for h in range(-12, 13):
        for k in range(-12, 13):
            for l in range(-12, 13):
                if h == k == l == 0:
                    continue
                if (h % 2 + k % 2 + l % 2) not in (0, 3):  # FCC: all even or all odd
                    continue
                d = a / math.sqrt(h * h + k * k + l * l)
                s = wavelength / (2 * d)
                if s >= 1.0:
                    continue
                key = round(2 * math.degrees(math.asin(s)), 4)
                reflections[key] = reflections.get(key, 0) + 1
    lines = sorted(reflections.items())
    print(json.dumps({"tool": "pyloop", "seed": seed, "lines": len(lines),
                      "first": lines[0][0], "multiplicity": lines[0][1]}))


if __name__ == "__main__":
    main()
