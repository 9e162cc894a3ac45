#!/usr/bin/python3
"""Tool execution: FFT of a diffraction-like signal (numpy).

A 1-D powder pattern (Lorentzian Bragg peaks of a cubic lattice on a sloping background, with
Poisson-like noise) and a 2-D far-field pattern of a finite lattice of apertures: the
transforms an RL agent's analysis tool would run. Deterministic for a given seed.

    python3 fft.py SEED
"""
import json
import sys

import numpy as np


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    rng = np.random.default_rng(seed)
    # 1-D: intensity vs 2-theta for a cubic lattice constant a.
    a = 3.5 + rng.random()
    two_theta = np.linspace(10.0, 120.0, 1 << 16)
    q = 4 * np.pi * np.sin(np.radians(two_theta / 2)) / 1.5406
    signal = 50.0 + 0.2 * two_theta
    for h, k, l in [(1, 1, 1), (2, 0, 0), (2, 2, 0), (3, 1, 1), (2, 2, 2), (4, 0, 0)]:
        q_hkl = 2 * np.pi * np.sqrt(h * h + k * k + l * l) / a
        signal += 1000.0 / (1 + ((q - q_hkl) / 0.01) ** 2)
    signal = rng.poisson(signal).astype(np.float64)
    spectrum = np.abs(np.fft.rfft(signal - signal.mean())) ** 2
    autocorr = np.fft.irfft(spectrum)[: len(signal) // 2]
    # 2-D: far field of an 8x8 lattice of square apertures on a 256x256 grid.
    grid = np.zeros((256, 256))
    pitch = 16 + seed % 8
    for i in range(8):
        for j in range(8):
            grid[i * pitch : i * pitch + 4, j * pitch : j * pitch + 4] = 1.0
    far = np.abs(np.fft.fftshift(np.fft.fft2(grid))) ** 2
    print(json.dumps({"tool": "fft", "seed": seed,
                      "peak_bin": int(np.argmax(spectrum[1:]) + 1),
                      "autocorr0": float(autocorr[0]),
                      "far_max": float(far.max())}))


if __name__ == "__main__":
    main()
