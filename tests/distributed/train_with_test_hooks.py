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
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "train"))

from retrieval import main  # noqa: E402

from pksampler.comm import world_info  # noqa: E402
from pksampler.train.hooks import HookBase  # noqa: E402


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

        from pksampler.train.device import resolve_device
        from pksampler.train.rules import ConfigError

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


class WritePid(HookBase):
    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def before_train(self) -> None:
        (self.folder / f"{world_info()[0]}.pid").write_text(str(os.getpid()))


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
    variant = os.environ.get("PKSAMPLER_TEST_RANK_SET")
    if variant:
        rank, setting = variant.split(":", 1)
        if world_info()[0] == int(rank):
            argv += ["--set", setting]
    return argv, hooks


if __name__ == "__main__":
    arguments, extra_hooks = _arguments()
    sys.exit(main(arguments, extra_hooks))
