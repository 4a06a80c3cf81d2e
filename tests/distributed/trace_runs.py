"""Several short trainings in one launch (a launch costs ~20 s): one backend, one run per named config.

``python trace_runs.py RUNS.json``: RUNS.json maps a run's name to its config
(a YAML path or null for the default), ``--set`` overrides and optionally a
``dtype`` (``"float64"``: see :func:`computing_in`), and a ``marker`` rank 0
prints with each run's name before it; each rank trains them in
order, each in ``<workspace root>/<name>``, so one launch per world size
serves every config a trace check compares.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from pksampler.train import run_setup
from pksampler.train.config.load import load_config
from pksampler.train.engine.elastic import choose_run_mode
from pksampler.train.engine.trainer import Trainer
from pksampler.train.losses.headed import HeadedLoss
from pksampler.train.run_setup import train
from pksampler.train.runtime import loader
from pksampler.train.runtime.distributed import make_backend


@contextmanager
def computing_in(dtype: str | None) -> Iterator[None]:
    """Train in ``dtype`` inside the block (None: as the trainer does, in float32).

    The trainer computes in float32, where another world size's summation
    order changes a sum by about 10⁻⁷; in float64 by about 10⁻¹⁶. A trace that
    drifts across world sizes in float32 and not in float64 is float32's
    rounding amplified by the training; one that drifts in both is a real
    difference (an order of rows, a divisor, a parameter outside the averaged
    set). The model and the headed loss (the head's rows, its BNNeck) are
    converted as they are built, the augmented images on their way into the
    model, and the step's ``.float()`` casts keep ``dtype``.
    """
    if dtype is None:
        yield
        return
    kind, plain_float = getattr(torch, dtype), torch.Tensor.float
    plain = (loader.to_model_input, run_setup.build_model, HeadedLoss.__dict__["from_config"],
             Trainer.forward_backward)

    def forward_backward(self: Trainer, *args: Any, **kwargs: Any) -> None:
        torch.Tensor.float = lambda tensor, *_, **__: tensor.to(kind)  # the step's casts, not the augmentation's
        try:
            plain[3](self, *args, **kwargs)
        finally:
            torch.Tensor.float = plain_float

    loader.to_model_input = lambda images, setup, transform: plain[0](images, setup, transform).to(kind)
    run_setup.build_model = lambda *args, **kwargs: plain[1](*args, **kwargs).to(kind)
    HeadedLoss.from_config = classmethod(lambda cls, *args, **kwargs: plain[2].__func__(cls, *args, **kwargs).to(kind))
    Trainer.forward_backward = forward_backward
    try:
        yield
    finally:
        loader.to_model_input, run_setup.build_model, HeadedLoss.from_config, Trainer.forward_backward = plain


def run_all(runs_file: Path) -> None:
    spec = json.loads(runs_file.read_text())
    configs = {name: load_config(run["config"], [*run["set"], f"workspace={Path(spec['root']) / name}"], environ={})
               for name, run in spec["runs"].items()}
    first = next(iter(configs.values()))
    backend = make_backend(first.distributed.backend, device=first.train.device, precision=first.train.precision,
                           collective_timeout=first.train.collective_timeout,
                           horovod_wait=first.distributed.horovod_wait)
    try:
        for name, config in configs.items():
            if backend.rank == 0:  # where each run's lines start in the launch's output (trainer_runs.run_output)
                sys.stdout.write(f"{spec['marker']}{name}\n")  # one write: another rank's line cannot split it
                sys.stdout.flush()
            with computing_in(spec["runs"][name].get("dtype")):
                train(config, backend, mode=choose_run_mode(backend, commit_every=config.train.commit_every))
        backend.barrier()
    finally:
        backend.shutdown()


if __name__ == "__main__":
    run_all(Path(sys.argv[1]))
    # Every run is written and the process group destroyed. Several DDP-wrapped trainings in one process leave
    # C++ threads that the interpreter's teardown can destroy while joinable ("terminate called without an active
    # exception", SIGABRT, seen under torchrun with a loaded machine): end here instead of tearing down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
