"""A bragg-rl environment that misbehaves on purpose, for tests/rl/test_loop.py.

What it does with a turn is decided by a hash of the turn's text (a random model's turns are
random text, so every kind of fault turns up within a few steps):

    crash      the tool server exits 3 mid-call
    hang       it sleeps past the task's tool timeout
    oom        it allocates past the sandbox's memory limit
    otherwise  the observation "ok\n"

The verifier's reward is 1 for a first turn of even length, else 0, and it raises (exit 1) for
one rollout in five (by a hash of all its turns): bragg-rl must drop those trajectories with the reason counted. Set
CHAOS=0 in the sandbox's environment (or run `serve calm`) for a well-behaved run.
"""

import hashlib
import os
import time

try:
    from env import Done, Environment, Observation, Rollout, main
except ImportError:
    from bragg_rl.env import Done, Environment, Observation, Rollout, main


def fate(text):
    return int(hashlib.sha256(text.encode("utf-8", "replace")).hexdigest(), 16) % 20


CALM = os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "calm"))


class ChaosEnv(Environment):
    def step(self, text):
        f = -1 if CALM else fate(text)
        if f == 0:
            os._exit(3)
        if f == 1:
            time.sleep(3600)
        if f == 2:
            hog = bytearray(1 << 30)
            hog[:: 1 << 12] = b"x" * len(hog[:: 1 << 12])
        if "!" in text:
            return Done()
        return Observation("ok\n", tool="chaos")

    def reward(self, rollout: Rollout) -> float:
        first = rollout.turns[0] if rollout.turns else ""
        # Keyed on every turn, not the first alone: a small model repeats its first turns, and
        # a run of six steps must see a crash (about 60 rollouts, nearly all distinct).
        if not CALM and rollout.turns and fate("\0".join(rollout.turns) + "verifier") % 5 == 0:
            raise RuntimeError("the verifier crashed")
        return float(len(first) % 2 == 0)


if __name__ == "__main__":
    main(ChaosEnv)
