#!/usr/bin/python3
"""Benchmark peer: runsc_peer.py with --pin, so that `runsc run` by hand gets the CPUs a pbox
gVisor sandbox gets by default (one each, in turn) and create and exec compare at equal CPUs.
bench/pbox/run.py runs it beside the unpinned runsc_peer.py. Same arguments and JSON."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runsc_peer  # noqa: E402

if __name__ == "__main__":
    sys.argv.insert(1, "--pin")
    runsc_peer.main()
