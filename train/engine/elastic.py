"""Horovod elastic training: the trainer under ``hvd.elastic.run``.

``horovodrun -np 4 --min-np 2 --max-np 4 --host-discovery-script S python
train/retrieval.py`` sets ``HOROVOD_ELASTIC=1`` in every worker; the trainer
then runs its epochs inside ``hvd.elastic.run`` (:func:`run_elastic`) with a
``TorchState`` that holds the model, the loss (its parameters and buffers),
the optimizer, the lr schedule, the loop's :class:`TrainState` and the
sampler. Horovod picks a handler per value by type; :func:`state_handlers`
adds handlers for the types Horovod does not know or handles in a way that
does not fit:

* pksampler samplers (:class:`SamplerHandler`): save = the sampler's
  position (epoch, seed, next global step), restore = load it, sync =
  rank 0's position is broadcast, then every rank rebuilds its sampler for
  the new world (its own share of the G classes of a global step) and loads
  the position. The global plan does not depend on the world size, so no
  global step is repeated or skipped (Horovod's ``ElasticSampler`` re-splits
  a shuffled index list and repeats samples, horovod#3399).
* :class:`TrainState` (epoch, batches done, global step, best) and the lr schedule: copies,
  restored in place, broadcast from rank 0.
* a loss with a row-sharded head (:class:`HeadHandler`): save = this rank's
  rows and momentum and a replica of one rank's on another host, so a host
  that leaves takes no rows with it; after a reset every rank of the new
  world (joiners too) receives its new range from whoever holds it.
* optimizers: the state dict is broadcast and loaded; Horovod's own handler
  first takes a zero-gradient step on a rank with an empty state (a
  joiner), which moves weight-decayed parameters after they were synced.

The loop commits in memory every ``train.commit_every`` global steps and at
the end of each epoch (:class:`CommitHook`); a commit also checks for hosts
added or removed. After a reset (a worker lost, a host added or removed)
the survivors roll back to the last commit, every rank rebuilds its share
for the new world size, a joiner receives the state, and training goes on.
The learning rate follows the global batch G x K, which the world size does
not change, so a reset leaves it alone.

metrics.jsonl keeps every global step once: step records are buffered on
every rank and appended by the current rank 0 at each commit
(:class:`CommittedMetricsHook`); steps rolled back are never written.

A checkpoint is taken only at a commit (:func:`register_commits`): before
``last.pt`` is built, every rank commits in memory and the buffered lines
are appended, so ``last.pt``, the commit a reset rolls back to and
metrics.jsonl agree on the last step. A resume cuts metrics.jsonl back to
``last.pt``'s step, so a checkpoint ahead of the log would lose the steps
in between for good (issue 27: ``checkpoint_every=3``, ``commit_every=100``,
steps 1-3 lost), and lines written ahead of the commit would be written
again after a rollback. A job killed between the lines and the checkpoint
file resumes from the earlier ``last.pt`` and cuts the extra lines. Such a
commit does not check for host changes (the next regular one does), so a
due checkpoint is always written; it costs one more in-memory copy of the
state per checkpoint.

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

import copy
import functools
import hashlib
import json
import os
import socket
import sys
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from pksampler.train.engine.hooks import CheckpointHook, HookBase
from pksampler.train.errors import ConfigError
from pksampler.train.engine.trainer import Trainer, TrainState, replay_history
from pksampler.train.runtime.workspace import WorkspaceLock

__all__ = [
    "CommitHook",
    "CommittedMetricsHook",
    "ELASTIC_TIMEOUT_ENV",
    "SamplerHandler",
    "elastic_launch",
    "loop_position",
    "register_commits",
    "rejoin_timeout",
    "run_elastic",
    "state_handlers",
]

#: Horovod's driver waits this long (seconds) for enough hosts after a membership change
ELASTIC_TIMEOUT_ENV = "HOROVOD_ELASTIC_TIMEOUT"
_HOROVOD_DEFAULT_TIMEOUT = 600.0
#: a worker gives up this much earlier than the driver, so the job ends with the worker's message
_REJOIN_MARGIN = 5.0
#: exit status of a worker that could not re-join (fewer hosts than --min-np)
REJOIN_EXIT_STATUS = 4


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


# --- state handlers -----------------------------------------------------------------


def _broadcast(value: Any, name: str) -> Any:
    from pksampler import comm

    return comm.broadcast_object(value, 0, name=name)


def _base_handler() -> type:
    from horovod.torch.elastic.state import StateHandler

    return StateHandler


class SamplerHandler:
    """Elastic state of a pksampler sampler: its position, and its share rebuilt for each new world.

    ``position()`` gives the sampler's resumable position (epoch, seed, the
    next global step: the trainer's count, since a DataLoader runs ahead of
    the loop); ``rebuild(position)`` builds this rank's sampler for the
    current world size, loads the position and returns it.
    """

    def __init__(self, sampler: Any, *, position: Callable[[], dict[str, Any]],
                 rebuild: Callable[[dict[str, Any]], Any]) -> None:
        self.value = sampler
        self.position, self.rebuild = position, rebuild
        self._saved = copy.deepcopy(position())

    def save(self) -> None:
        self._saved = copy.deepcopy(self.position())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        # Rank 0's committed position; every rank derives its own share of G for the new world from it.
        self._saved = _broadcast(self._saved, "pksampler.elastic.sampler")
        self.reshard()

    def reshard(self) -> None:
        """This rank's sampler for the current world at the committed position.

        Called by sync and after every reset: when hosts were only removed,
        Horovod skips the sync (every survivor holds the committed state), but
        the survivors' shares of G still change.
        """
        self.value = self.rebuild(copy.deepcopy(self._saved))

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _TrainStateHandler:
    """The loop's :class:`TrainState`: a deep copy per commit, restored in place (hooks hold the object)."""

    def __init__(self, value: TrainState) -> None:
        self.value = value
        self.save()

    def _fields(self) -> dict[str, Any]:
        return {f.name: copy.deepcopy(getattr(self.value, f.name)) for f in fields(self.value)}

    def save(self) -> None:
        self._saved = self._fields()

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self.value, name, value)

    def sync(self) -> None:
        for name, value in _broadcast(self._fields(), "pksampler.elastic.train_state").items():
            setattr(self.value, name, value)

    def set_value(self, value: TrainState) -> None:
        self.value = value
        self.save()


class _StateDictHandler:
    """Anything with ``state_dict``/``load_state_dict`` (optimizer, lr schedule): copied, broadcast, loaded."""

    name = "pksampler.elastic.state_dict"

    def __init__(self, value: Any) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(_broadcast(self.value.state_dict(), f"{self.name}.{type(self.value).__name__}"))

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class HeadHandler:
    """Elastic state of a loss with a row-sharded head (``HeadedLoss``): own range + one replica, re-assembled.

    A commit (:meth:`save`, a collective: every rank commits at the same step)
    keeps a host copy of this rank's rows and momentum and receives a replica
    of another rank's range, on another host when there is one
    (:mod:`~pksampler.train.modeling.head_replicas`): 2 × ⌈C/W⌉·k·D floats of
    rows and as many of momentum per rank, never the whole head. A new world
    assembles its ranges from whoever holds them (:meth:`assemble`): in the
    sync when Horovod runs one, else (hosts only left: Horovod skips it) at
    the start of the body (:meth:`ensure_current`); the reset callback
    (:meth:`reshard`) only marks the range stale, since joiners are not in
    it. ``grad_divisor()`` is the new world's loss scale; ``host()`` names
    this rank's host (equal numbers: one host). Nothing here is collective at
    construction: a joiner builds its state before it meets the survivors.
    """

    name = "pksampler.elastic.head"

    def __init__(self, value: Any, *, grad_divisor: Callable[[], float], resumed: dict[str, Any] | None = None,
                 host: Callable[[], int] = lambda: host_key()) -> None:
        from pksampler.train.modeling.head_replicas import RangeCopy

        self.value, self.grad_divisor, self.host = value, grad_divisor, host
        self._dense: dict[str, Any] | None = None
        self._copies: list[Any] = []
        self._step, self._world = -1, 0
        self.current = False  # this rank's range is the current world's (set by an assembly)
        if resumed is not None:
            # rank 0 of a resumed run holds the checkpoint's whole head (one copy of [0, C)); the first
            # assembly gives every rank its range of it (each built only its own, and only rank 0 read the file)
            head = dict(resumed["head"])
            rows, momentum = head.pop("rows"), head.pop("momentum")
            self._dense = {**resumed, "head": head}
            self._copies = [RangeCopy(0, rows.shape[0], rows, momentum)]
            self._step, self._world = int(head["step"]), 1

    @property
    def copies(self) -> list[Any]:
        """The committed ranges this rank holds (:class:`~pksampler.train.modeling.head_replicas.RangeCopy`)."""
        return list(self._copies)

    def save(self) -> None:
        from pksampler.train.modeling.head_replicas import exchange_replica, replica_shift
        from pksampler.train.modeling.sharded_head import shard_range

        loss = self.value
        collectives, classes = loss.head.collectives, loss.head.num_classes
        dense, own = loss.own_range()
        hosts = collectives.allgather(torch.tensor([self.host()], dtype=torch.int64)).cpu().tolist()
        ranges = [shard_range(classes, collectives.size, r) for r in range(collectives.size)]
        replica = exchange_replica(own, ranges, collectives=collectives, shift=replica_shift(hosts))
        # replaced only now: a commit cut short by a lost rank leaves the previous one whole
        self._dense, self._copies = dense, [own] + ([replica] if replica is not None else [])
        self._step, self._world = int(dense["head"]["step"]), collectives.size
        self.current = True

    def restore(self) -> None:
        """Nothing yet: the world is gone; the assembly that follows the reset rebuilds the range."""

    def sync(self) -> None:
        self.assemble()

    def reshard(self) -> None:
        """A reset callback (survivors only, joiners are not here): the range is stale until the next assembly."""
        self.current = False

    def ensure_current(self) -> None:
        """At the start of the body: assemble if no sync did since the last reset (a collective on every rank or
        on none: Horovod skips the sync on every survivor alike, and then there are no joiners)."""
        if not self.current:
            self.assemble()

    def assemble(self) -> None:
        """This rank's range of the committed head for the current world, from whoever holds it (a collective).

        Every rank reports its copies (one small all-gather); the plan is the
        same on every rank, so a range held by no rank raises
        :class:`~pksampler.train.modeling.head_replicas.HeadRowsLost` on
        every rank. No copy anywhere: no step was committed, the initial rows.
        """
        from pksampler.train.modeling import head_replicas
        from pksampler.train.modeling.sharded_head import shard_range

        loss = self.value
        collectives, classes = loss.head.collectives, loss.head.num_classes
        row = head_replicas.holder_row(self._step, self._world, self._copies)
        table = collectives.allgather(torch.from_numpy(row)[None]).cpu().numpy()
        step, segments = head_replicas.plan_segments(table, classes)
        if step < 0:
            loss.reshard(None, grad_divisor=self.grad_divisor())
        else:
            root = 0 if table[0, 0] == step else int((table[:, 0] == step).argmax())
            dense = collectives.broadcast_object(self._dense if collectives.rank == root else None, root,
                                                 name=self.name)
            ranges = [shard_range(classes, collectives.size, r) for r in range(collectives.size)]
            loss.load_assembled(dense, functools.partial(head_replicas.assemble, self._copies, segments, ranges,
                                                         collectives=collectives), grad_divisor=self.grad_divisor())
        self.current = True

    def set_value(self, value: Any) -> None:
        self.value = value


def host_key() -> int:
    """This process's host as a number: Horovod's name for it (``HOROVOD_HOSTNAME``), else the machine's name.

    Horovod's name tells apart the "hosts" of one machine in ``-H
    localhost:2,127.0.0.1:2`` (the tests' two hosts).
    """
    name = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


def _as_state_handler(cls: type) -> type:
    """``cls`` as a subclass of Horovod's ``StateHandler`` (imported only when Horovod is used)."""
    return type(cls.__name__, (cls, _base_handler()), {})


def state_handlers(sampler_type: type, sampler_handler: Callable[[Any], SamplerHandler],
                   extra: Sequence[tuple[type, Callable[[Any], Any]]] = ()) -> list[tuple[type, Callable[[Any], Any]]]:
    """Horovod's handler registry with pksampler's handlers first (the first matching type wins).

    ``sampler_handler(sampler)`` makes the handler of a pksampler sampler of
    ``sampler_type`` (it needs the trainer's position and a rebuild function);
    ``extra`` come before the rest (the sharded head's loss).
    """
    from horovod.torch.elastic.state import ModelStateHandler

    return [
        (sampler_type, sampler_handler),
        *extra,
        (TrainState, _as_state_handler(_TrainStateHandler)),
        (torch.optim.lr_scheduler.LRScheduler, _as_state_handler(_StateDictHandler)),
        (torch.optim.Optimizer, _as_state_handler(_StateDictHandler)),
        (torch.nn.Module, ModelStateHandler),
    ]


# --- hooks --------------------------------------------------------------------------


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


class CommittedMetricsHook(HookBase):
    """metrics.jsonl under Horovod elastic: the run's events, written by the current rank 0 at each commit.

    Every rank buffers the step records (and takes the per-epoch records of
    the storage at the commit); after a reset the buffer, holding the steps
    after the last commit, is dropped. So a step trained again after a
    rollback is written once, by whichever process is rank 0 when it is
    committed. Replaces :class:`~.hooks.MetricsLogHook`.
    """

    def __init__(self, path: Path, is_main: Callable[[], bool]) -> None:
        self.path, self.is_main = path, is_main
        self.pending: list[str] = []
        self.flushed: list[str] = []  # the last commit's lines, on every rank: a new rank 0 may need them
        self._cursor = 0

    def before_train(self) -> None:
        # Records already in the storage were written (a resumed run's history) or rolled back (a reset).
        self._cursor = len(self.trainer.storage.records())

    def after_step(self) -> None:
        record = self.trainer.storage.latest_step
        if record is not None:
            self.pending.append(json.dumps(record))

    def flush(self) -> None:
        """Called at a commit: the buffered steps and the records put since the last commit are final."""
        records, self._cursor = self.trainer.storage.records_since(self._cursor)
        lines = self.pending + [json.dumps(record) for record in records]
        if lines and self.is_main():
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("".join(f"{line}\n" for line in lines))
        if lines:
            self.flushed = lines
        self.pending.clear()

    def repair(self) -> None:
        """For a process that has just become rank 0: the log as the last commit left it.

        The old rank 0 may have died inside that commit: before it wrote the
        commit's lines (every rank keeps them, :attr:`flushed`), or in the
        middle of one (a line cut short, dropped here).
        """
        if not self.path.is_file():
            return
        with open(self.path, "rb+") as handle:
            data = handle.read()
            if data and not data.endswith(b"\n"):
                handle.truncate(data.rfind(b"\n") + 1)
                data = data[: data.rfind(b"\n") + 1]
        written = {_line_key(line) for line in data.decode("utf-8").splitlines()[-4 * max(len(self.flushed), 1):]}
        missing = [line for line in self.flushed if _line_key(line) not in written]
        if missing:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("".join(f"{line}\n" for line in missing))

    def drop(self) -> None:
        """Called at a reset: the buffered steps are rolled back."""
        self.pending.clear()


def _line_key(line: str) -> tuple[Any, ...]:
    """What tells two metrics.jsonl lines apart across ranks (their timings differ): type, step, epoch."""
    try:
        record = json.loads(line)
    except ValueError:
        return (line,)
    return record.get("type"), record.get("global_step"), record.get("epoch")


def register_commits(trainer: Trainer, state: Any, metrics: CommittedMetricsHook,
                     checkpoints: CheckpointHook | None, *, every: int) -> None:
    """The commits of a Horovod elastic run, and the rule that a checkpoint is taken only at a commit.

    ``state`` is Horovod's ``TorchState`` (any object with ``save()`` and
    ``check_host_updates()``). A commit saves the state in memory and
    appends the buffered lines to metrics.jsonl (:meth:`CommittedMetricsHook.flush`,
    between the save and the host check):

    1. every ``every`` global steps, at the last step and after each epoch
       (:class:`CommitHook`, registered last), with the host check;
    2. before every ``last.pt`` (``checkpoints.commit``), without it.

    ``metrics`` goes first among the hooks, so a step's line is buffered
    (and a resumed run's records are skipped) before a checkpoint of that
    step commits.
    """
    def commit_in_memory() -> None:
        state.save()
        metrics.flush()

    def commit() -> None:
        commit_in_memory()
        state.check_host_updates()

    trainer.register([metrics], first=True)
    trainer.register([CommitHook(commit, every=every)])
    if checkpoints is not None:
        checkpoints.commit = commit_in_memory


# --- the driver ---------------------------------------------------------------------


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


def _keep_hooks_open_across_resets(trainer: Trainer) -> None:
    """Skip the hooks' ``after_train`` when a reset, not the end of training, leaves the loop.

    The loop calls ``after_train`` on the way out of any exception; a reset
    (a worker lost, hosts changed) re-enters it, and a hook that closed its
    writer there (TensorBoard) would log nothing more.
    """
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    def guarded(after_train: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(after_train)
        def call() -> None:
            if not isinstance(sys.exc_info()[1], (HorovodInternalError, HostsUpdatedInterrupt)):
                after_train()
        return call

    for hook in trainer.hooks:
        hook.after_train = guarded(hook.after_train)  # type: ignore[method-assign]


def loop_position(trainer: Trainer) -> dict[str, Any]:
    """The sampler's state at the loop's position: the epoch and the batches done in it, from :class:`TrainState`.

    Read from the train state, which a reset restores and syncs with the
    rest, not from the sampler's iterator: after a reset the sampler is new
    and the loop's count of the interrupted iteration is stale.
    """
    state = trainer.state
    return {**trainer.parts.sampler.state_dict(batches_consumed=0), "epoch": state.epoch, "step": state.consumed}


def _refresh_world(trainer: Trainer, gather_wanted: bool) -> None:
    """The backend's rank and size after a reset; the gathered loss and the lr follow."""
    from pksampler import comm

    backend, parts = trainer.parts.backend, trainer.parts
    backend.rank, backend.size = comm.world_info()
    backend.local_rank = comm.local_rank()
    backend.gathered_loss_scale = float(backend.size)
    parts.gather = gather_wanted and backend.size > 1


#: how long a new rank 0 waits for the workspace lock of the rank 0 whose host left (its process is stopping)
TAKE_OVER_WAIT_SECONDS = 60.0


def _take_over_the_workspace(trainer: Trainer, lock: WorkspaceLock, metrics: CommittedMetricsHook) -> None:
    """After a reset: a process that became rank 0 (the old one's host left) takes the workspace.

    It takes the lock, completes the log if the old rank 0 died inside the
    last commit (:meth:`CommittedMetricsHook.repair`; an evaluation the old
    rank 0 logged after the previous commit is the one thing it cannot
    restore, as only rank 0 holds it), and its event storage becomes the committed history
    in ``metrics.jsonl`` with its best and latest evaluation (put by the old
    rank 0 only; the state sync that follows gives them to every rank), so
    the curves, ``final_metrics.json``, ``best.pt`` and later records are
    written by this process from here on.
    """
    if trainer.parts.backend.rank != 0 or lock.held:
        return
    lock.acquire(wait_seconds=TAKE_OVER_WAIT_SECONDS)
    metrics.repair()
    replay_history(trainer, metrics.path)
    print(f"[pksampler] Horovod elastic: rank 0's host left; this process (pid {os.getpid()}) is rank 0 now and "
          f"writes the workspace {metrics.path.parent}", flush=True)


def run_elastic(trainer: Trainer, *, commit_every: int, rebuild_sampler: Callable[[int, int], Any],
                gather_wanted: bool, metrics_path: Path, checkpoints: CheckpointHook | None = None,
                before_start: Callable[[], None] = lambda: None,
                workspace_lock: WorkspaceLock | None = None,
                loss_state: dict[str, Any] | None = None) -> TrainState:
    """Train under ``hvd.elastic.run``; returns the final state.

    ``rebuild_sampler(world_size, rank)`` builds this rank's sampler for a
    world; ``checkpoints``, the run's checkpoint hook, then writes ``last.pt``
    only at a commit (:func:`register_commits`); ``before_start`` runs on
    every rank of each new world before its first step (collective checks
    belong there, never before ``hvd.elastic.run``: a joiner would meet the
    survivors' sync). ``workspace_lock`` (held by rank 0) is taken by the
    process that becomes rank 0 when the old one's host leaves. ``loss_state``:
    on rank 0 of a resumed run, the checkpoint's loss state (a sharded head's
    rows reach the other ranks through the first sync).
    """
    import horovod.torch as hvd
    from horovod.common.elastic import run_fn
    from horovod.torch.elastic import state as hvd_state

    parts, backend = trainer.parts, trainer.parts.backend

    def rebuild(position: dict[str, Any]) -> Any:
        sampler = rebuild_sampler(backend.size, backend.rank)
        sampler.load_state_dict(position)
        parts.sampler = sampler
        if parts.loader is not None:
            parts.loader.batches.batch_sampler = sampler  # the persistent loader draws from the new world's share
        return sampler

    made: list[SamplerHandler] = []

    def sampler_handler(sampler: Any) -> SamplerHandler:
        made.append(_as_state_handler(SamplerHandler)(sampler, position=lambda: loop_position(trainer),
                                                      rebuild=rebuild))
        return made[-1]

    heads: list[HeadHandler] = []

    def head_handler(loss: Any) -> HeadHandler:
        heads.append(_as_state_handler(HeadHandler)(loss, grad_divisor=lambda: backend.gathered_loss_scale,
                                                    resumed=loss_state))
        return heads[-1]

    sharded = [(type(parts.loss_fn), head_handler)] if hasattr(parts.loss_fn, "reshard") else []
    hvd_state.set_handler_registry(state_handlers(type(parts.sampler), sampler_handler, sharded))
    state = hvd.elastic.TorchState(model=parts.model, optimizer=parts.optimizer, loss=parts.loss_fn,
                                   scheduler=parts.scheduler, sampler=parts.sampler, train=trainer.state)
    metrics = CommittedMetricsHook(metrics_path, lambda: backend.rank == 0)
    callbacks = [functools.partial(_refresh_world, trainer, gather_wanted), metrics.drop, made[0].reshard,
                 *(head.reshard for head in heads)]
    if workspace_lock is not None:
        callbacks.append(functools.partial(_take_over_the_workspace, trainer, workspace_lock, metrics))
    state.register_reset_callbacks(callbacks)
    register_commits(trainer, state, metrics, checkpoints, every=commit_every)
    _keep_hooks_open_across_resets(trainer)

    def body(state: Any) -> TrainState:
        # Synced: every rank holds rank 0's committed state and its own share for this world (the head's is
        # assembled here when Horovod skipped the sync: hosts only left).
        for head in heads:
            head.ensure_current()
        state.save()
        before_start()
        return trainer.train()

    return run_fn(body, functools.partial(_rejoin_with_deadline, rejoin_timeout()))(state)
