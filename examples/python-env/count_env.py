"""A toy bragg-rl environment in Python: count one past N, after asking the `double` tool.

The prompt says a number N (its meta carries it: {"prompt": "count 7\n", "meta": {"n": 7}}). The
model has two commands, one per turn:

    double K     -> the observation "2K\n" (tool "double"); a K that is not an integer is an
                    error observation
    answer M     -> the rollout is over (Done)

Reward: 1.0 when the rollout ended with "answer N+1" after at least one "double" turn, else 0.

One file, both commands (README.md):

    python3 count_env.py serve      # task.tool_server
    python3 count_env.py verify     # task.verifier

`env` is bragg_rl's env.py copied next to this file (a sandbox sees only /task); in the source
tree, bragg_rl.env is used instead.
"""

import re

try:
    from env import Done, Environment, Observation, Rollout, main
except ImportError:  # not copied: the bragg_rl package (PYTHONPATH=<build>/python)
    from bragg_rl.env import Done, Environment, Observation, Rollout, main

COMMAND = re.compile(r"\s*(double|answer)\s+(\S+)\s*$")


def parse(text):
    """(command, argument) of a turn, or None when it is neither command."""
    m = COMMAND.match(text)
    return (m.group(1), m.group(2)) if m else None


class CountEnv(Environment):
    def reset(self):
        self.doubles = 0

    def step(self, text):
        command = parse(text)
        if command is None:
            return Observation("error: say `double K` or `answer M`\n", error=True)
        name, arg = command
        if name == "answer":
            return Done()
        self.doubles += 1
        return Observation(f"{2 * int(arg)}\n", tool="double")  # ValueError: an error observation

    def reward(self, rollout: Rollout) -> float:
        n = rollout.meta.get("n")
        if not isinstance(n, int):
            n = int(re.search(r"-?\d+", rollout.prompt).group())
        commands = [parse(t) for t in rollout.turns]
        doubled = any(c is not None and c[0] == "double" for c in commands[:-1])
        last = commands[-1] if commands else None
        answered = last is not None and last[0] == "answer" and last[1] == str(n + 1)
        return 1.0 if rollout.done and doubled and answered else 0.0


if __name__ == "__main__":
    main(CountEnv)
