"""bragg-reshard across the nodes of a Ray cluster.

    from bragg_reshard.ray import convert
    convert(src="/ckpt/iter_0001000", dst="/ckpt/hf", world_size=8, hf_config_dir="/ckpt/hf-cfg")

or, from a shell on any node of the cluster:

    python -m bragg_reshard.ray --src ... --dst ... --world-size 8 [--hf-config-dir ...]
                               [--address auto] [-- EXTRA bragg-reshard convert OPTIONS]

Rank i of `world_size` runs `bragg-reshard convert --rank i --world-size N` as a Ray task (one
CPU each, spread over the nodes), exactly as `srun` runs it under Slurm: each rank writes its own
output shards and the last one to finish writes the index, so the output is byte for byte the
same as any other rank split. `src` and `dst` must be a shared file system every node sees;
`bragg-reshard` must be on every node's PATH (or given as `binary`). Ray is imported only when
this module is used (`pip install bragg[ray]`).
"""

import argparse
import os
import shutil
import subprocess
import sys


class ConversionError(RuntimeError):
    """A rank failed; `failures` maps each failed rank to (exit status, the end of its log)."""

    def __init__(self, failures):
        self.failures = failures
        lines = [f"rank {r} exited with {rc}: {tail}" for r, (rc, tail) in sorted(failures.items())]
        super().__init__("bragg-reshard failed on Ray:\n" + "\n".join(lines))


def _run_rank(binary, args, rank, world_size):
    """One rank on whichever node Ray placed it: (rank, exit status, node, log tail)."""
    import socket
    cmd = [binary, "convert", *args, "--rank", str(rank), "--world-size", str(world_size)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # the binary is missing on this node
        return rank, 127, socket.gethostname(), f"{binary}: {e}"
    tail = (p.stderr or p.stdout)[-2000:]
    return rank, p.returncode, socket.gethostname(), tail


def convert(src, dst, world_size, hf_config_dir=None, model=None, extra_args=(), binary=None,
            address=None, num_cpus=1):
    """Converts `src` into `dst` with `world_size` Ray tasks; returns {rank: node}.

    Joins the cluster at `address` (None: ray.init()'s own rules, RAY_ADDRESS or a local
    cluster) unless Ray is already initialised. Raises ConversionError naming every rank that
    failed (the others' shards stay; a rerun writes everything again)."""
    import ray
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    binary = binary or shutil.which("bragg-reshard") or "bragg-reshard"
    args = ["--src", os.path.abspath(src), "--dst", os.path.abspath(dst)]
    if hf_config_dir:
        args += ["--hf-config-dir", os.path.abspath(hf_config_dir)]
    if model:
        args += ["--model", model]
    args += list(extra_args)
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    task = ray.remote(num_cpus=num_cpus, scheduling_strategy="SPREAD", max_retries=0)(_run_rank)
    results = ray.get([task.remote(binary, args, r, world_size) for r in range(world_size)])
    failures = {r: (rc, tail) for r, rc, _, tail in results if rc != 0}
    if failures:
        raise ConversionError(failures)
    return {r: node for r, _, node, _ in results}


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bragg_reshard.ray",
        description="bragg-reshard convert across the nodes of a Ray cluster")
    ap.add_argument("--src", required=True)
    ap.add_argument("--dst", required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--hf-config-dir")
    ap.add_argument("--model")
    ap.add_argument("--binary", help="bragg-reshard on every node (default: from PATH)")
    ap.add_argument("--address", help="the Ray cluster (default: RAY_ADDRESS, else a local one)")
    ap.add_argument("extra", nargs="*", help="after --: more bragg-reshard convert options")
    a = ap.parse_args(argv)
    try:
        nodes = convert(a.src, a.dst, a.world_size, a.hf_config_dir, a.model, a.extra, a.binary,
                        a.address)
    except ConversionError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"bragg-reshard: {a.world_size} ranks on {len(set(nodes.values()))} node(s) done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
