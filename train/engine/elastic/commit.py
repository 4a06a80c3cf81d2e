"""Horovod elastic's commits: the state saved in memory, the held metrics lines written, the hosts checked.

The loop commits every ``train.commit_every`` global steps, at the last step
and after each epoch (:class:`CommitHook`, registered last, so a commit sees
the step as every other hook left it); a commit also checks for hosts added
or removed. After a reset the survivors roll back to the last commit.

A checkpoint is taken only at a commit (:meth:`Commits.in_memory` is the
checkpoint hook's ``commit``): before ``last.pt`` is built, every rank
commits in memory and the held lines are appended, so ``last.pt``, the
commit a reset rolls back to and metrics.jsonl agree on the last step. A
resume cuts metrics.jsonl back to ``last.pt``'s step, so a checkpoint ahead
of the log would lose the steps in between for good (issue 27:
``checkpoint_every=3``, ``commit_every=100``, steps 1-3 lost), and lines
written ahead of the commit would be written again after a rollback. A job
killed between the lines and the checkpoint file resumes from the earlier
``last.pt`` and cuts the extra lines. Such a commit does not check for host
changes (the next regular one does), so a due checkpoint is always written;
it costs one more in-memory copy of the state per checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable

from pksampler.train.engine.trainer import HookBase
from pksampler.train.engine.writers import CommittedJSONWriter, WriterHook

__all__ = ["CommitHook", "Commits"]


class Commits:
    """The commits of one run: ``state`` is Horovod's ``TorchState`` (any object with ``save()`` and
    ``check_host_updates()``); ``writers`` the run's writer hook, ``log`` its held metrics lines."""

    def __init__(self, state: Any, writers: WriterHook, log: CommittedJSONWriter) -> None:
        self.state, self.writers, self.log = state, writers, log

    def in_memory(self) -> None:
        """Save the state, then make the held lines final (the records put since the last commit included)."""
        self.state.save()
        self.writers.flush()
        self.log.commit()

    def __call__(self) -> None:
        """A regular commit: in memory, then the host check (which may interrupt the loop to reset)."""
        self.in_memory()
        self.state.check_host_updates()


class CommitHook(HookBase):
    """``commit()`` every ``every`` global steps, at the last step and after each epoch.

    Registered last, so a commit sees the step as every other hook left it.
    """

    def __init__(self, commit: Callable[[], None], *, every: int) -> None:
        self.commit, self.every = commit, every

    def after_step(self) -> None:
        if self.trainer.state.global_step % self.every == 0 or self.trainer.state.stop:
            self.commit()

    def after_epoch(self) -> None:
        self.commit()
