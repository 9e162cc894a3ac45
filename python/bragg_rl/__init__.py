"""bragg_rl: the Python side of bragg-rl, the asynchronous RL controller (src/rl, docs/rl.md).

Two independent modules, imported by name so that neither pulls in the other's dependencies:

- ``bragg_rl.plots``: reads a run's ``metrics.jsonl`` and draws its curves (reward against
  wall-clock and step, staleness, where the time went) and a summary; numpy and matplotlib only,
  runs under Debian's ``/usr/bin/python3``. ``python -m bragg_rl.plots RUN_DIR``.
- ``bragg_rl.megatron``: turns the packed THD rows bragg-rl writes for a Megatron-LM training
  loop into Megatron's ``PackedSeqParams`` and the tensors a GRPO loss takes; needs torch and
  megatron-core (the Python peer environment, python/peers.lock).
"""

__all__ = ["plots", "megatron"]
