"""train/retrieval.py with test-only behaviour, chosen by environment variables.

``PKSAMPLER_TEST_CRASH=rank:step``: that rank exits with status 3 after that
global step (a hook injected here, never part of the trainer).
``PKSAMPLER_TEST_RAISE=step``: every rank raises a RuntimeError after that
global step (an unexpected exception).
``PKSAMPLER_TEST_RANK_SET=rank:key=value``: that rank alone gets an extra
``--set key=value`` (ranks that disagree).
``PKSAMPLER_TEST_FREEZE=rank:step``: that rank stops responding (sleeps) after that global step.
``PKSAMPLER_TEST_PIDS=folder``: every rank writes ``folder/<rank>.pid`` before training.
``PKSAMPLER_TEST_AUDIT=folder``: every rank records the files it opens for
writing under that folder (Python's audit hooks see every ``open`` and
``os.open``) and, after training, prints one ``[audit]`` line: rank, local
rank, pid, the device its local rank selects on a host with two GPUs, the
determinism settings it ran with and the files it wrote.
``PKSAMPLER_TEST_NORM_STATS=folder``: after training every rank writes its
BatchNorm running statistics to ``folder/<rank>.json``.
``PKSAMPLER_TEST_RECORD=folder``: every rank appends, per global step, the
sample indices it trained to ``folder/<pid>.jsonl`` (needs
``data.workers=0``, so the images are fetched in the rank's own process).
``PKSAMPLER_TEST_HOLD_FOR_HOSTS=step``: under Horovod elastic, rank 0 waits after that global step until the
driver has told it that the hosts changed (an event: the driver notifies the coordinator, rank 0, which
broadcasts it at the next commit; the other ranks wait in that step's collectives), so a run whose steps are
short cannot end before a host joins.
``PKSAMPLER_TEST_DTYPE=float64``: the model, the headed loss and the step compute in that dtype
(trace_runs.py's :func:`computing_in`), so a comparison with one process is not lost in float32's amplified
rounding.
``PKSAMPLER_TEST_TOY_TABLE=folder``: a hook keeps a second row-sharded table
(tests/toy_table.py's :class:`ToyTable`, the sharded-state protocol) that every step adds its
global step to; after training every rank writes its range to
``folder/<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "train"))
sys.path.insert(0, str(ROOT / "tests"))

from retrieval import exit_with, main  # noqa: E402

from pksampler.comm import world_info  # noqa: E402
from pksampler.train.engine.hooks import HookBase  # noqa: E402
from toy_table import ToyTable  # noqa: E402
from trace_runs import computing_in  # noqa: E402


class CrashAt(HookBase):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def after_step(self) -> None:
        if world_info()[0] == self.rank and self.trainer.state.global_step == self.step:
            print(f"[test] rank {self.rank}: simulated crash at step {self.step}", flush=True)
            os._exit(3)


class Audit(HookBase):
    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT

    def __init__(self, folder: str) -> None:
        self.folder, self.written = os.path.realpath(folder), set()
        sys.addaudithook(self._record)

    def _record(self, event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)) or not (args[2] or 0) & self._WRITE:
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(self.folder + os.sep):
            self.written.add(os.path.relpath(path, self.folder))

    def after_train(self) -> None:
        import torch

        from pksampler.train.runtime.device import resolve_device
        from pksampler.train.errors import ConfigError

        backend = self.trainer.parts.backend
        try:
            device = resolve_device("cuda", backend.local_rank, cuda_available=True, cuda_count=2)
        except ConfigError as error:  # one node of 4 ranks would need 4 GPUs
            device = error
        print("[audit] " + json.dumps({
            "rank": backend.rank, "local_rank": backend.local_rank, "size": backend.size, "pid": os.getpid(),
            "device_on_two_gpus": str(device), "fusion_threshold": os.environ.get("HOROVOD_FUSION_THRESHOLD"),
            "deterministic_kernels": torch.are_deterministic_algorithms_enabled(), "written": sorted(self.written)}),
            flush=True)


class WriteNormStatistics(HookBase):
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def after_train(self) -> None:
        from pksampler.train.engine.norm_stats import running_statistics

        values = [buffer.tolist() for buffer in running_statistics(self.trainer.parts.model)]
        (self.folder / f"{world_info()[0]}.json").write_text(json.dumps(values))


class RaiseAt(HookBase):
    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self) -> None:
        if self.trainer.state.global_step == self.step:
            raise RuntimeError(f"unexpected failure injected at step {self.step}")


class FreezeAt(HookBase):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def after_step(self) -> None:
        if world_info()[0] == self.rank and self.trainer.state.global_step == self.step:
            print(f"[test] rank {self.rank}: frozen at step {self.step}", flush=True)
            time.sleep(3600)


class HoldForHosts(HookBase):
    """After global step ``step`` rank 0 waits (at most ``timeout`` s, below the tests' Gloo timeout) for Horovod's
    notice that the hosts changed; the commit after it then resets every rank into the new world."""

    def __init__(self, step: int, timeout: float = 120.0) -> None:
        self.step, self.timeout, self.updated = step, timeout, threading.Event()

    def before_train(self) -> None:
        from horovod.common.elastic import notification_manager

        notification_manager.register_listener(self)

    def on_hosts_updated(self, timestamp, update_res) -> None:  # Horovod's listener protocol
        self.updated.set()

    def after_step(self) -> None:
        if self.trainer.state.global_step == self.step and world_info()[0] == 0 and \
                not self.updated.wait(self.timeout):
            raise RuntimeError(f"no hosts update reached this rank within {self.timeout:.0f} s of step {self.step}")


class WritePid(HookBase):
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def before_train(self) -> None:
        (self.folder / f"{world_info()[0]}.pid").write_text(str(os.getpid()))


class _RecordingDataset:
    """The training set, noting every index fetched (in the loop's process when data.workers=0)."""

    def __init__(self, inner) -> None:
        self.inner, self.fetched = inner, []

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        self.fetched.append(int(index))
        return self.inner[index]

    def __getitems__(self, indices):
        return [self[i] for i in indices]

    def __getattr__(self, name):
        return getattr(self.inner, name)


class RecordBatches(HookBase):
    """Per global step, the indices this rank trained, the world it ran in and when that world started."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / f"{os.getpid()}.jsonl"
        self.world_started = 0.0

    def before_train(self) -> None:
        parts = self.trainer.parts
        if not isinstance(parts.train_set, _RecordingDataset):
            parts.train_set = _RecordingDataset(parts.train_set)
            if parts.loader is not None:  # the loader built once reads through KeyedSamples.dataset
                parts.loader.loader.dataset.dataset = parts.train_set
        parts.train_set.fetched.clear()
        # One stamp per world (rank 0's clock), so a test can tell a replayed step's last run.
        self.world_started = parts.backend.broadcast_object(time.time(), name="pksampler.test.world")

    def after_step(self) -> None:
        parts, state = self.trainer.parts, self.trainer.state
        record = dict(global_step=state.global_step, epoch=state.epoch, step=state.consumed, rank=parts.backend.rank,
                      size=parts.backend.size, world_started=self.world_started,
                      host=os.environ.get("HOROVOD_HOSTNAME", ""),  # the slot's host as Horovod names it
                      indices=sorted(parts.train_set.fetched),
                      parameters=float(sum(p.detach().double().sum() for p in parts.model.parameters())),
                      time=time.time())
        parts.train_set.fetched.clear()
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


class KeepToyTable(HookBase):
    """The :class:`ToyTable`'s owner: it shares the table with the trainer and steps it; at the end, every rank's
    range goes to ``folder/<rank>.json``."""

    def __init__(self, folder: str) -> None:
        self.folder, self.table = Path(folder), None

    def shares(self):
        self.table = ToyTable(self.trainer.parts.backend.world)  # at registration: the backend's world
        return (self.table,)

    def after_step(self) -> None:
        self.table.rows[:, 0] += self.trainer.state.global_step

    def after_train(self) -> None:
        backend = self.trainer.parts.backend
        record = {"size": backend.size, "step": self.trainer.state.global_step, "lo": self.table.lo,
                  "hi": self.table.hi, "rows": self.table.rows.tolist()}
        (self.folder / f"{backend.rank}.json").write_text(json.dumps(record))


def _arguments() -> tuple[list[str], list[HookBase]]:
    argv, hooks = sys.argv[1:], []
    crash = os.environ.get("PKSAMPLER_TEST_CRASH")
    if crash:
        rank, step = (int(v) for v in crash.split(":"))
        hooks.append(CrashAt(rank, step))
    if os.environ.get("PKSAMPLER_TEST_RAISE"):
        hooks.append(RaiseAt(int(os.environ["PKSAMPLER_TEST_RAISE"])))
    freeze = os.environ.get("PKSAMPLER_TEST_FREEZE")
    if freeze:
        rank, step = (int(v) for v in freeze.split(":"))
        hooks.append(FreezeAt(rank, step))
    if os.environ.get("PKSAMPLER_TEST_PIDS"):
        hooks.append(WritePid(os.environ["PKSAMPLER_TEST_PIDS"]))
    if os.environ.get("PKSAMPLER_TEST_AUDIT"):
        hooks.append(Audit(os.environ["PKSAMPLER_TEST_AUDIT"]))
    if os.environ.get("PKSAMPLER_TEST_NORM_STATS"):
        hooks.append(WriteNormStatistics(os.environ["PKSAMPLER_TEST_NORM_STATS"]))
    if os.environ.get("PKSAMPLER_TEST_RECORD"):
        hooks.append(RecordBatches(Path(os.environ["PKSAMPLER_TEST_RECORD"])))
    if os.environ.get("PKSAMPLER_TEST_HOLD_FOR_HOSTS"):
        hooks.append(HoldForHosts(int(os.environ["PKSAMPLER_TEST_HOLD_FOR_HOSTS"])))
    if os.environ.get("PKSAMPLER_TEST_TOY_TABLE"):
        hooks.append(KeepToyTable(os.environ["PKSAMPLER_TEST_TOY_TABLE"]))
    variant = os.environ.get("PKSAMPLER_TEST_RANK_SET")
    if variant:
        rank, setting = variant.split(":", 1)
        if world_info()[0] == int(rank):
            argv += ["--set", setting]
    return argv, hooks


if __name__ == "__main__":
    arguments, extra_hooks = _arguments()
    with computing_in(os.environ.get("PKSAMPLER_TEST_DTYPE")):
        status = main(arguments, extra_hooks)
    exit_with(status)
