"""The Horovod elastic run mode: the loop under ``hvd.elastic.run``, a new world after every reset.

``horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script S python
train/retrieval.py`` sets ``HOROVOD_ELASTIC=1`` in every worker
(:func:`elastic_launch`); the run mode (:class:`HorovodElasticMode`, chosen
once in ``main``) then runs the epochs inside ``hvd.elastic.run`` with a
``TorchState`` that holds the model, the loss (its parameters and buffers),
the optimizer, the lr schedule, the loop's :class:`TrainState` and the
sampler (:mod:`.handlers`).

After a reset (a worker lost, a host added or removed) the survivors roll
back to the last commit (:mod:`.commit`), then one reset callback reads the
new :class:`~pksampler.world.World` and gives it to the trainer
(:meth:`Trainer.set_world`: the backend, the sampler, the sharded head's
loss, then every hook's ``on_world_change``), a joiner receives the state,
and training goes on. The learning rate follows the global batch G x K,
which the world size does not change, so a reset leaves it alone.

metrics.jsonl keeps every global step once: its lines are held on every
rank and appended by the current rank 0 at each commit
(:class:`~pksampler.train.engine.writers.CommittedJSONWriter`); steps rolled
back are never written. A process that becomes rank 0 takes the workspace
(:meth:`HorovodElasticMode._take_over`).

Below ``--min-np`` Horovod's driver waits ``HOROVOD_ELASTIC_TIMEOUT``
seconds (``--elastic-timeout``; default 600) for hosts, then kills the
workers and ends with a message about a worker's exit status, not the cause
(horovod#3494). A worker that has waited 5 s less than that to re-join
prints one line naming the cause and exits first
(:func:`_rejoin_with_deadline`), so ``HOROVOD_ELASTIC_TIMEOUT=40`` ends
such a job within a minute, with that line. The timeout must exceed a
joiner's start-up: survivors re-join only once the joiners have started.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from pksampler.world import World

from pksampler.train.engine.checkpoint import CheckpointWriter
from pksampler.train.engine.elastic.commit import CommitHook, Commits
from pksampler.train.engine.elastic.handlers import (SamplerHandler, SharedPartHandler, Shared, as_state_handler,
                                                     state_handlers)
from pksampler.train.engine.hooks import CheckpointHook, OnMainRank
from pksampler.train.engine.mode import RunMode
from pksampler.train.engine.trainer import HookBase, Trainer, TrainState, replay_history
from pksampler.train.engine.writers import CommittedJSONWriter, EventWriter, OnMainRankWriter, WriterHook
from pksampler.train.errors import ConfigError
from pksampler.train.runtime.workspace import EventLog, WorkspaceLock

__all__ = ["ELASTIC_TIMEOUT_ENV", "ElasticResetLoop", "HorovodElasticMode", "REJOIN_EXIT_STATUS", "ResetLoopGuard",
           "TAKE_OVER_WAIT_SECONDS", "elastic_launch", "loop_position", "rejoin_timeout"]

#: Horovod's driver waits this long (seconds) for enough hosts after a membership change
ELASTIC_TIMEOUT_ENV = "HOROVOD_ELASTIC_TIMEOUT"
_HOROVOD_DEFAULT_TIMEOUT = 600.0
#: a worker gives up this much earlier than the driver, so the job ends with the worker's message
_REJOIN_MARGIN = 5.0
#: exit status of a worker that could not re-join (fewer hosts than --min-np)
REJOIN_EXIT_STATUS = 4
#: how long a new rank 0 waits for the workspace lock of the rank 0 whose host left (its process is stopping)
TAKE_OVER_WAIT_SECONDS = 60.0


def elastic_launch() -> bool:
    """True in a worker started by ``horovodrun`` with a host-discovery script (it sets ``HOROVOD_ELASTIC=1``)."""
    return os.environ.get("HOROVOD_ELASTIC", "0") == "1"


def rejoin_timeout() -> float:
    """Seconds a worker waits for a new world after a reset: 5 s less than Horovod's driver waits for hosts."""
    value = os.environ.get(ELASTIC_TIMEOUT_ENV)
    if not value:
        return _HOROVOD_DEFAULT_TIMEOUT - _REJOIN_MARGIN
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > _REJOIN_MARGIN:
        raise ConfigError(f"{ELASTIC_TIMEOUT_ENV}={value!r}: expected a number of seconds above {_REJOIN_MARGIN:.0f}")
    return seconds - _REJOIN_MARGIN


def _rejoin_with_deadline(seconds: float) -> None:
    """Horovod's reset (shutdown, init) with a deadline: a worker left without a world says so and exits.

    Below ``--min-np`` the driver assigns no new world and ``hvd.init()``
    would wait for the driver's own timeout (600 s by default,
    horovod#3494).
    """
    import horovod.torch as hvd

    def give_up() -> None:
        print(f"[pksampler] error: Horovod elastic: no new world within {seconds:.0f} s after a membership change: "
              f"fewer slots than --min-np (or joiners slower to start than {ELASTIC_TIMEOUT_ENV} allows); this "
              "worker stops. Start the job again when hosts are back: it resumes from the last checkpoint "
              "(WORKSPACE/checkpoints/last.pt) if one was written, else from the start",
              file=sys.stderr, flush=True)
        os._exit(REJOIN_EXIT_STATUS)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        hvd.shutdown()
        hvd.init()
    finally:
        timer.cancel()


class ElasticResetLoop(RuntimeError):
    """The same collective failed again and again in the same world at the same step: a defect, not a lost host."""


class ResetLoopGuard:
    """Ends a Horovod elastic job whose resets cannot help, in one line, instead of resetting forever.

    Horovod's ``run_fn`` answers every ``HorovodInternalError`` with a
    rollback and a reset, silently, and tries again. A collective that fails
    for a reason of its own (ranks that disagree on a tensor's dtype or
    shape: Horovod refuses it and stays up) fails the same way in the same
    world at the same step on every try, and the job would loop without a
    word. :meth:`failed` counts such repeats and, at ``repeats``, raises
    :class:`ElasticResetLoop` with the collective's message. A lost rank is
    not counted: it shuts Horovod down (:data:`PEER_LOST`, the same message
    whoever left), and the driver answers it, also when spare hosts of the
    same size replace the lost ones (joiners that die in the state sync, at
    the committed step, one after another) until none is left.
    """

    #: Horovod's message for a collective that a lost rank ended (its background loop shut down)
    PEER_LOST = "Horovod has been shut down"

    def __init__(self, repeats: int = 3) -> None:
        self.repeats, self._last, self._count = repeats, None, 0

    def failed(self, error: BaseException, *, step: int, world_size: int) -> None:
        """Note a failed collective (``error``) at global ``step`` in a world of ``world_size``; raise when the same
        refused collective has now been seen ``repeats`` times in a row (a lost rank starts the count again)."""
        if self.PEER_LOST in str(error):
            self._last, self._count = None, 0
            return
        key = (step, world_size, str(error))
        self._count = self._count + 1 if key == self._last else 1
        self._last = key
        if self._count >= self.repeats:
            raise ElasticResetLoop(
                f"Horovod elastic: the same collective failed {self._count} times in a row at step {step} in a "
                f"world of {world_size} ranks each time, so a reset cannot help: "
                f"{' '.join(str(error).split())[:300]}") from error


def loop_position(trainer: Trainer) -> dict[str, Any]:
    """The sampler's state at the loop's position: the epoch and the batches done in it, from :class:`TrainState`.

    Read from the train state, which a reset restores and syncs with the
    rest, not from the sampler's iterator: after a reset the loop's count of
    the interrupted iteration is stale.
    """
    state = trainer.state
    return {**trainer.parts.sampler.state_dict(batches_consumed=0), "epoch": state.epoch, "step": state.consumed}


class HorovodElasticMode(RunMode):
    """Horovod elastic (``horovodrun --host-discovery-script``): the world may change at every commit.

    ``commit_every``: global steps between in-memory commits (``train.commit_every``).
    """

    keeps_commits = True

    def __init__(self, backend: Any, *, commit_every: int) -> None:
        super().__init__(backend)
        self.commit_every = commit_every
        self._checks: list[Callable[[], None]] = []
        self._log: CommittedJSONWriter | None = None
        self._writers: WriterHook | None = None
        self._lock: WorkspaceLock | None = None
        self._commits: Commits | None = None

    def raise_together(self, error: Exception | None) -> None:
        """Each rank raises its own: nothing collective may run before ``hvd.elastic.run``."""
        if error is not None:
            raise error

    def agree(self, check: Callable[[], None]) -> None:
        """Run in every new world, on every rank, before its first step."""
        self._checks.append(check)

    def resume(self, state: dict[str, Any] | None) -> dict[str, Any] | None:
        """Rank 0 alone holds the checkpoint; the first state sync sends it (each shared part's rows: its first
        assembly, every rank reading its own range's files)."""
        return state

    def broadcast_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Nothing now: the state sync broadcasts everything."""

    def main_only(self, builders: Sequence[Callable[[], HookBase]]) -> list[HookBase]:
        """Rank-0 hooks held by every process, built and run by whichever one is rank 0 (:class:`OnMainRank`)."""
        return [OnMainRank(build, self.is_main) for build in builders]

    def main_writers(self, builders: Sequence[Callable[[], EventWriter]]) -> list[EventWriter]:
        return [OnMainRankWriter(build, self.is_main) for build in builders]

    def metrics_writer(self, log: EventLog) -> EventWriter:
        """metrics.jsonl's lines held on every rank until a commit; rank 0 at the commit appends them."""
        self._log = CommittedJSONWriter(log.path, self.is_main)
        return self._log

    def writer_hooks(self, hooks: list[HookBase], writers: Sequence[EventWriter]) -> list[HookBase]:
        """The writer hook goes first: a step's line is held (and a resumed run's records skipped) before a
        checkpoint of that step commits."""
        self._writers = WriterHook(writers)
        return [self._writers, *hooks]

    def workspace_lock(self, lock: WorkspaceLock | None, workspace: Path) -> WorkspaceLock:
        """Rank 0's lock, or one that this process takes if it becomes rank 0."""
        self._lock = lock if lock is not None else WorkspaceLock(workspace)
        return self._lock

    def checkpoints(self, workspace: Path, *, every: int, max_steps: int | None,
                    metadata: dict[str, Any]) -> CheckpointHook:
        """Every process may become rank 0, so every one holds a writer; ``last.pt`` waits for a commit."""
        return self._checkpoint_hook(CheckpointWriter(), workspace, every=every, max_steps=max_steps,
                                     metadata=metadata, commit=self._commit_in_memory)

    def _commit_in_memory(self) -> None:
        if self._commits is None:
            raise RuntimeError("HorovodElasticMode: a checkpoint before hvd.elastic.run started (no commit yet)")
        self._commits.in_memory()

    def run(self, trainer: Trainer) -> TrainState:
        """Train under ``hvd.elastic.run``; returns the final state."""
        import horovod.torch as hvd
        from horovod.common.elastic import run_fn
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

        if self._log is None or self._writers is None:
            raise RuntimeError("HorovodElasticMode.run: the run has no metrics writer (metrics_writer, writer_hooks)")
        state, handlers, shards = self._state(trainer)
        self._commits = Commits(state, self._writers, self._log)
        trainer.register([CommitHook(self._commits, every=self.commit_every)])
        state.register_reset_callbacks([functools.partial(self._on_reset, trainer, handlers)])

        guard = ResetLoopGuard()

        def guarded(work: Callable[[], Any]) -> Any:
            try:
                return work()
            except HorovodInternalError as error:
                guard.failed(error, step=trainer.state.global_step, world_size=hvd.size())
                raise

        def body(state: Any) -> TrainState:
            # Synced: every rank holds rank 0's committed state and its own share for this world (each shared
            # part's is assembled here when Horovod skipped the sync: hosts only left).
            for handler in shards:
                handler.ensure_current()
            state.save()
            for check in self._checks:
                check()
            return trainer.train(interrupted_by=(HorovodInternalError, HostsUpdatedInterrupt))

        state.sync = functools.partial(guarded, state.sync)  # Horovod's run_fn calls it before body after a reset
        return run_fn(lambda state: guarded(functools.partial(body, state)),
                      functools.partial(_rejoin_with_deadline, rejoin_timeout()))(state)

    def _state(self, trainer: Trainer) -> tuple[Any, list[Any], list[SharedPartHandler]]:
        """Horovod's ``TorchState`` of the run with pksampler's handlers; those it made (in order) and, of them,
        one :class:`SharedPartHandler` per item of :attr:`StepParts.shared` (each held as a :class:`Shared`)."""
        import horovod.torch as hvd
        from horovod.torch.elastic import state as hvd_state

        parts, made, shards = trainer.parts, [], []

        def sampler_handler(sampler: Any) -> SamplerHandler:
            made.append(as_state_handler(SamplerHandler)(sampler, position=lambda: loop_position(trainer)))
            return made[-1]

        def shard_handler(shared: Shared) -> SharedPartHandler:
            # rank 0 of a resumed job holds what the checkpoint says of each shared part: it starts from that
            shards.append(as_state_handler(SharedPartHandler)(shared, collectives=parts.backend,
                                                         resumed=trainer.resumed_share(shared.key),
                                                         name=f"pksampler.elastic.shared{len(shards)}"))
            made.append(shards[-1])
            return shards[-1]

        hvd_state.set_handler_registry(state_handlers(type(parts.sampler), sampler_handler,
                                                      [(Shared, shard_handler)]))
        shared = {f"shared{i}": Shared(part, key) for i, (key, part) in enumerate(trainer.shared_parts())}
        loss = {} if any(part is parts.loss_fn for part in parts.shared) else {"loss": parts.loss_fn}
        state = hvd.elastic.TorchState(model=parts.model, optimizer=parts.optimizer, **loss,
                                       scheduler=parts.scheduler, sampler=parts.sampler, train=trainer.state, **shared)
        return state, made, shards

    def _on_reset(self, trainer: Trainer, handlers: list[Any]) -> None:
        """After Horovod's reset (survivors only): the new world to every part and hook, the committed sampler
        position, the head's range marked stale, and the workspace for a process that became rank 0."""
        trainer.set_world(World.detect())
        for handler in handlers:
            handler.on_reset()
        self._take_over(trainer)

    def _take_over(self, trainer: Trainer) -> None:
        """A process that became rank 0 (the old one's host left) takes the workspace.

        It takes the lock, completes the log if the old rank 0 died inside the
        last commit (:meth:`CommittedJSONWriter.repair`; an evaluation the old
        rank 0 logged after the previous commit is the one thing it cannot
        restore, as only rank 0 holds it), and its event storage becomes the
        committed history in ``metrics.jsonl`` with its best and latest
        evaluation (put by the old rank 0 only; the state sync that follows
        gives them to every rank), so the curves, ``final_metrics.json``,
        ``best.pt`` and later records are written by this process from here on.
        """
        if not self.is_main() or self._lock is None or self._lock.held or self._log is None:
            return
        self._lock.acquire(wait_seconds=TAKE_OVER_WAIT_SECONDS)
        self._log.repair()
        replay_history(trainer, self._log.path)
        print(f"[pksampler] Horovod elastic: rank 0's host left; this process (pid {os.getpid()}) is rank 0 now and "
              f"writes the workspace {self._log.path.parent}", flush=True)
