"""bragg-engine on a CPU its OpenBLAS does not know (engine::ReexecForKnownBlasCore).

Debian 12's OpenBLAS (0.3.21) falls back to its Prescott (SSE3) kernels on CPUs newer than it,
and torch's fp32 GEMMs run 1.6-3x slower. A Bragg program then starts itself again, in the same
process, with OPENBLAS_CORETYPE naming a core whose kernels the CPU runs; a user's own
OPENBLAS_CORETYPE is kept. Checked through bragg-engine's "CPU math" line and its environment.
"""

import os
import subprocess
import sys
import tempfile
import unittest

ENGINE = os.environ["BRAGG_ENGINE"]
WRITE = os.environ["BRAGG_WRITE_TINY_MODEL"]


def cpu_flags():
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def start_engine(model, env):
    """Starts bragg-engine; returns (its pid, its environment, its CPU math line)."""
    p = subprocess.Popen([ENGINE, "--model", model, "--listen", "127.0.0.1:0", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        math, seen = None, []
        for line in p.stdout:
            seen.append(line)
            if "CPU math:" in line:
                math = line.split("CPU math:", 1)[1].strip()
            if line.startswith("listening on "):
                break
        if p.poll() is not None or math is None:
            raise AssertionError("bragg-engine did not start:\n" + "".join(seen))
        with open(f"/proc/{p.pid}/environ", "rb") as fh:
            environ = dict(kv.split(b"=", 1) for kv in fh.read().split(b"\0") if b"=" in kv)
        return p.pid, {k.decode(): v.decode() for k, v in environ.items()}, math
    finally:
        p.kill()
        p.wait()


class BlasCore(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="bragg-blas-core-")
        cls.model = os.path.join(cls.tmp.name, "m")
        subprocess.run([WRITE, cls.model, "--layers", "1"], check=True)
        cls.env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_engine_never_runs_prescott_kernels_on_a_cpu_with_avx2(self):
        _, environ, math = start_engine(self.model, self.env)
        self.assertIn("OpenBLAS", math, "scripts/install-deps installs OpenBLAS for torch")
        flags = cpu_flags()
        if {"avx2", "fma"} <= flags:
            self.assertNotIn(" Prescott ", math)
        # Started again with the variable only when OpenBLAS fell back, and then it says so.
        if "OPENBLAS_CORETYPE" in environ:
            core = environ["OPENBLAS_CORETYPE"]
            wanted = ("Cooperlake", "SkylakeX") if "avx512f" in flags else ("Haswell",)
            self.assertIn(core, wanted)
            self.assertIn(f"OPENBLAS_CORETYPE={core}", math)

    def test_a_users_own_core_type_is_kept(self):
        env = dict(self.env, OPENBLAS_CORETYPE="Prescott")
        _, environ, math = start_engine(self.model, env)
        self.assertEqual(environ.get("OPENBLAS_CORETYPE"), "Prescott")
        self.assertIn(" Prescott ", math)
        self.assertIn("OPENBLAS_CORETYPE=Prescott", math)


if __name__ == "__main__":
    sys.exit(unittest.main())
