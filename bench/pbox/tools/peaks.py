#!/usr/bin/python3
"""Tool execution: peak finding in a diffraction pattern.

scipy.signal.find_peaks when scipy is installed, else a pure-numpy local-maximum search with the
same height and distance rules; then a centroid refinement of each peak. Deterministic for a
given seed.

    python3 peaks.py SEED
"""
import json
import sys

import numpy as np


def find_peaks_numpy(y, height, distance):
    inner = (y[1:-1] > y[:-2]) & (y[1:-1] >= y[2:]) & (y[1:-1] > height)
    idx = np.nonzero(inner)[0] + 1
    keep = []
    for i in idx[np.argsort(-y[idx])]:  # highest first, drop neighbours within distance
        if all(abs(int(i) - j) >= distance for j in keep):
            keep.append(int(i))
    return np.array(sorted(keep), dtype=np.int64)


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    rng = np.random.default_rng(seed)
    x = np.linspace(5.0, 90.0, 20000)
    centers = np.sort(rng.uniform(8.0, 87.0, 24))
    y = 20.0 + rng.normal(0.0, 2.0, x.size)
    for c in centers:
        width = rng.uniform(0.05, 0.2)
        y += rng.uniform(100.0, 1000.0) * np.exp(-0.5 * ((x - c) / width) ** 2)
    # Smooth out the counting noise (a 25-point box), then local maxima 60 above zero, at
    # least 50 points (0.2 degrees) apart.
    smooth = np.convolve(y, np.ones(25) / 25, mode="same")
    try:
        from scipy.signal import find_peaks
        idx, _ = find_peaks(smooth, height=60.0, distance=50, prominence=20.0)
        method = "scipy"
    except ImportError:
        idx = find_peaks_numpy(smooth, 60.0, 50)
        method = "numpy"
    refined = []
    for i in idx:
        lo, hi = max(0, i - 10), min(x.size, i + 11)
        w = y[lo:hi] - 20.0
        refined.append(float((x[lo:hi] * w).sum() / w.sum()))
    print(json.dumps({"tool": "peaks", "seed": seed, "method": method, "found": len(refined),
                      "planted": len(centers)}))


if __name__ == "__main__":
    main()
