#!/usr/bin/python3
"""Benchmark peer: runsc_peer.py with --pin and --isolate, so that `runsc run` by hand gets both
the CPUs a pbox gVisor sandbox gets by default (one each, in turn) and the isolation pbox's
gVisor runtime gives pbox-init: commands in a PID namespace of their own, under the agent's
seccomp program (docs/pbox.md). Create and exec then compare with pbox at equal CPUs and
equal isolation. The seccomp program is the one pboxd writes to <state-dir>/gvisor/seccomp.bpf,
named by $PBOX_INIT_SECCOMP (bench/pbox/run.py sets it) or --isolate; without it the peer is
skipped. Same arguments and JSON as runsc_peer.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peerlib  # noqa: E402
import runsc_peer  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--isolate" not in args:
        program = os.environ.get("PBOX_INIT_SECCOMP", "")
        if not program or not os.path.isfile(program):
            peerlib.skip("no seccomp program for pbox-init --isolate: set $PBOX_INIT_SECCOMP to "
                         "a pboxd's <state-dir>/gvisor/seccomp.bpf (bench/pbox/run.py does)")
        args = ["--isolate", program] + args
    sys.argv[1:] = ["--pin"] + args
    runsc_peer.main()
