"""bragg_rl: the Python side of bragg-rl, the asynchronous RL controller (src/rl, docs/rl.md).

Three independent modules, imported by name so that none pulls in another's dependencies:

- ``bragg_rl.plots``: reads a run's ``metrics.jsonl`` and draws its curves (reward against
  wall-clock and step, staleness, where the time went) and a summary; numpy and matplotlib only,
  runs under Debian's ``/usr/bin/python3``. ``python -m bragg_rl.plots RUN_DIR``.
- ``bragg_rl.megatron``: turns the packed THD rows bragg-rl writes for a Megatron-LM training
  loop into Megatron's ``PackedSeqParams`` and the tensors a GRPO loss takes; needs torch and
  megatron-core (the Python peer environment, python/peers.lock).
- ``bragg_rl.env``: environments written in Python: subclass ``Environment`` (``step``,
  ``reward``) and one file is both the task's tool server and its verifier
  (``python3 my_env.py serve|verify``); ``run`` starts ``bragg-rl run`` and returns the run's
  summary. Standard library only, one file meant to be copied into ``task.files`` next to the
  user's script (examples/python-env/).
"""

__all__ = ["plots", "megatron", "env"]
