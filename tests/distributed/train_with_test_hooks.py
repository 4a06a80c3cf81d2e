"""train/retrieval.py with test-only behaviour, chosen by environment variables.

``PKSAMPLER_TEST_CRASH=rank:step``: that rank exits with status 3 after that
global step (a hook injected here, never part of the trainer).
``PKSAMPLER_TEST_RAISE=step``: every rank raises a RuntimeError after that
global step (an unexpected exception).
``PKSAMPLER_TEST_RANK_SET=rank:key=value``: that rank alone gets an extra
``--set key=value`` (ranks that disagree).
``PKSAMPLER_TEST_FREEZE=rank:step``: that rank stops responding (sleeps) after that global step.
``PKSAMPLER_TEST_PIDS=folder``: every rank writes ``folder/<rank>.pid`` before training.
"""

from __future__ import annotations

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
    variant = os.environ.get("PKSAMPLER_TEST_RANK_SET")
    if variant:
        rank, setting = variant.split(":", 1)
        if world_info()[0] == int(rank):
            argv += ["--set", setting]
    return argv, hooks


if __name__ == "__main__":
    arguments, extra_hooks = _arguments()
    sys.exit(main(arguments, extra_hooks))
