"""Training: compiled training steps (``fusec.compile_training``), their data, checkpoints and
the ``fusec train`` command's loop. See ``fusec.train.plan`` for the plan, ``fusec.train.graphs``
for its entry points and state."""
