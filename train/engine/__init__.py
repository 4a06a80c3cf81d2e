"""The loop and everything around it: :class:`~.trainer.Trainer` with ``HookBase``, the hooks,
the run's :class:`~.events.EventStorage` and its writers (metrics log, progress, TensorBoard,
curves), checkpoints, Horovod elastic, background data checks. A loop variant is a
``Trainer`` subclass that overrides the step (detectron2's ``AMPTrainer(SimpleTrainer)``).
"""

from __future__ import annotations
