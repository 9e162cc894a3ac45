#!/usr/bin/python3
"""Stdin and stdout throughput of a command in a gVisor sandbox, through the whole path:
Python client -> gRPC Exec -> pboxd -> InitClient -> runsc's stdin/stdout -> pbox-init ->
the command's pipes. Compares this build's pboxd and pbox-init with another build's (--old),
one pboxd of each, measured in turn so that load drifting over the run falls on both.
Needs root, runsc and a build (pboxd, pbox-init, pbox_python).

    bench/pbox/gvisor_stdio_throughput.py --build build [--old DIR] [--mib 64] [--rounds 5]

DIR holds an older build's pboxd and pbox-init side by side. Stdin: `sha256sum` fed --mib MiB
(the digest is checked); stdout: `head -c <mib>M /dev/zero`, every byte read by the client.
Prints MiB/s (median and best of the rounds) per build and direction.
"""

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gvisor_create_ab  # noqa: E402


def stdin_mibps(sb, data, digest):
    t = time.monotonic()
    proc = sb.exec(["sha256sum"], stdin=True)
    view = memoryview(data)
    step = 1 << 20
    for off in range(0, len(data), step):
        proc.write_stdin(bytes(view[off:off + step]))
    proc.close_stdin()
    res = proc.communicate()
    dt = time.monotonic() - t
    if res.exit_code != 0 or not res.stdout.startswith(digest.encode()):
        sys.exit(f"gvisor_stdio_throughput: wrong digest {res.stdout[:64]!r}")
    return len(data) / dt / (1 << 20)


def stdout_mibps(sb, mib):
    t = time.monotonic()
    proc = sb.exec(["head", "-c", f"{mib}M", "/dev/zero"])
    n = sum(len(chunk) for chunk in proc.stdout_iter())
    dt = time.monotonic() - t
    if n != mib << 20:
        sys.exit(f"gvisor_stdio_throughput: got {n} bytes of stdout")
    return n / dt / (1 << 20)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--old", default="", help="directory with another build's pboxd, pbox-init")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    import pbox  # noqa: E402

    data = os.urandom(args.mib << 20)
    digest = hashlib.sha256(data).hexdigest()
    kinds = {"new": os.path.join(build, "src/pbox/pboxd")}
    if args.old:
        kinds["old"] = os.path.join(os.path.abspath(args.old), "pboxd")
    tmp = tempfile.mkdtemp(prefix="pbox-stdio-bench-")
    agents, clients, boxes = {}, {}, {}
    try:
        for k, binary in kinds.items():
            agents[k] = gvisor_create_ab.start_agent(None, f"{tmp}/{k}", [], pboxd=binary)
            clients[k] = pbox.Client(f"unix://{tmp}/{k}/s.sock")
            boxes[k] = clients[k].create(memory="1G")
        results = {k: ([], []) for k in kinds}
        for _ in range(args.rounds):
            for k in kinds:
                results[k][0].append(stdin_mibps(boxes[k], data, digest))
                results[k][1].append(stdout_mibps(boxes[k], args.mib))
        print(f"| build | stdin MiB/s median | best | stdout MiB/s median | best |  ({args.mib} MiB, "
              f"{args.rounds} rounds, load {os.getloadavg()[0]:.1f})")
        print("|---|---|---|---|---|")
        for k in kinds:
            i, o = results[k]
            print(f"| {k} | {statistics.median(i):.0f} | {max(i):.0f} | "
                  f"{statistics.median(o):.0f} | {max(o):.0f} |")
    finally:
        for k, sb in boxes.items():
            try:
                sb.destroy()
            except Exception:  # noqa: BLE001 - best effort teardown
                pass
        for proc in agents.values():
            proc.terminate()
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
