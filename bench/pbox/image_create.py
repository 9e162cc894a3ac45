#!/usr/bin/python3
"""Create time vs image size: p50 CreateSandbox for a large imported image against a small one.

    bench/pbox/image_create.py --build build [--small-mb 50] [--large-mb 2048] [--creates 60]

Builds two busybox root filesystem tarballs padded with generated files (1 MiB each, random
bytes), imports both into a fresh pboxd, then creates and destroys sandboxes from them in
alternation (so that load from other processes hits both alike) and prints p50/p90 of each
and their ratio. A sandbox's root is an OverlayFS mount over the image's layers, so the ratio
should be close to 1 whatever the image size. Needs root, busybox-static and ~3x the large
image size of free disk under --tmp.
"""

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUSYBOX = "/bin/busybox"


def start_agent(build, tmp, max_image):
    ready = os.path.join(tmp, "ready.json")
    sock = os.path.join(tmp, "pbox.sock")
    proc = subprocess.Popen(
        [os.path.join(build, "src/pbox/pboxd"), "--listen", "unix://" + sock,
         "--state-dir", os.path.join(tmp, "state"), "--ready-file", ready,
         "--max-image-bytes", str(max_image), "--log-level", "warn"])
    for _ in range(600):
        if os.path.exists(ready):
            return proc, "unix://" + sock
        if proc.poll() is not None:
            sys.exit("bench: pboxd exited early")
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    # A SIGKILLed agent leaves its cgroups (and any sandboxes) behind: reap them.
    subprocess.run([os.path.join(build, "src/pbox/pboxd"), "--reap", "--state-dir",
                    os.path.join(tmp, "state")], stdout=subprocess.DEVNULL)
    sys.exit("bench: pboxd did not become ready")


def make_image(path, mib):
    with tarfile.open(path, "w") as tar:
        for d in ("bin", "etc", "tmp", "data"):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(ti)
        tar.add(BUSYBOX, "bin/busybox")
        chunk = 1 << 20
        for i in range(mib):
            if i % 64 == 0:
                ti = tarfile.TarInfo(f"data/{i // 64}")
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(ti)
            data = os.urandom(chunk)
            ti = tarfile.TarInfo(f"data/{i // 64}/f{i}")
            ti.size = chunk
            tar.addfile(ti, fileobj=_Bytes(data))
    return os.path.getsize(path)


class _Bytes:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def read(self, n=-1):
        out = self.data[self.pos:self.pos + n if n >= 0 else None]
        self.pos += len(out)
        return out


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--small-mb", type=int, default=50)
    ap.add_argument("--large-mb", type=int, default=2048)
    ap.add_argument("--creates", type=int, default=60, help="per image")
    ap.add_argument("--tmp", default="/var/tmp")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sys.path.insert(0, os.path.join(build, "python"))
    import pbox  # noqa: E402

    tmp = tempfile.mkdtemp(prefix="pbox-imgbench-", dir=args.tmp)
    proc = None
    try:
        sizes = {}
        t0 = time.monotonic()
        for name, mib in (("small", args.small_mb), ("large", args.large_mb)):
            sizes[name] = make_image(os.path.join(tmp, f"{name}.tar"), mib)
        print(f"built images in {time.monotonic() - t0:.1f} s: "
              + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sizes.items()), flush=True)
        proc, endpoint = start_agent(build, tmp, 2 * max(sizes.values()))
        client = pbox.Client(endpoint)
        for name in ("small", "large"):
            t0 = time.monotonic()
            client.import_image(f"bench-{name}", os.path.join(tmp, f"{name}.tar"))
            print(f"imported {name} in {time.monotonic() - t0:.1f} s", flush=True)
            os.unlink(os.path.join(tmp, f"{name}.tar"))
        times = {"small": [], "large": []}
        for i in range(args.creates + 5):
            for name in ("small", "large") if i % 2 == 0 else ("large", "small"):
                t0 = time.perf_counter()
                sb = client.create(image=f"bench-{name}", memory="128M", disk="64M")
                dt = (time.perf_counter() - t0) * 1e3
                if i == 0:
                    r = sb.run([BUSYBOX, "sh", "-c", "du -sm /data | cut -f1"], timeout=120)
                    print(f"{name}: /data holds {r.stdout.decode().strip()} MiB", flush=True)
                sb.destroy()
                if i >= 5:  # warm-up
                    times[name].append(dt)
        p50 = {k: statistics.median(v) for k, v in times.items()}
        p90 = {k: pct(v, 0.9) for k, v in times.items()}
        load = os.getloadavg()[0]
        print(f"\n| image | size | creates | p50 create ms | p90 create ms |")
        print(f"|---|---:|---:|---:|---:|")
        for name in ("small", "large"):
            print(f"| {name} | {sizes[name] / 2**20:.0f} MiB | {len(times[name])} | "
                  f"{p50[name]:.2f} | {p90[name]:.2f} |")
        print(f"\nlarge/small p50 ratio: {p50['large'] / p50['small']:.3f} "
              f"(load average {load:.1f}, {os.cpu_count()} CPUs)")
        client.close()
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
