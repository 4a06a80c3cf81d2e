"""optim.clip_grad_norm: the reduced gradients are clipped before the step, after Horovod's synchronize(), with the
plain and the gradient-cached step alike.

One unit test pins the order of the calls with a recording backend; one run
in real processes (horovodrun -np 2, the cached step) trains what one process
with the plain step and the same clip trains, and a clip that bites changes
the model (the clipped and the unclipped one-process runs share one process).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from launch import launch
from trainer_runs import trace_launch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cached_step import SCRIPT, checkpoint, max_difference, write_config  # noqa: E402

from pksampler.train.engine.trainer import StepParts, Trainer, clip_gradients  # noqa: E402


class _RecordingBackend:
    """Horovod's calls, recorded: ``synchronize`` finishes the allreduce, ``skip_synchronize`` wraps the step."""

    size, rank, name = 1, 0, "recording"
    setup = SimpleNamespace()

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.inside_skip = False

    def synchronize(self, optimizer) -> None:
        self.calls.append("synchronize")

    @contextlib.contextmanager
    def skip_synchronize(self, optimizer):
        self.inside_skip = True
        try:
            yield
        finally:
            self.inside_skip = False


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, params, backend: _RecordingBackend) -> None:
        super().__init__(params, lr=0.1)
        self.backend, self.norms = backend, []

    def step(self, closure=None):
        assert self.backend.inside_skip and self.backend.calls == ["synchronize"]
        self.norms.append(float(torch.cat([p.grad.flatten() for g in self.param_groups for p in g["params"]]).norm()))
        return super().step(closure)


def test_the_step_clips_after_synchronize_and_steps_without_a_second_one():
    model = torch.nn.Linear(4, 3)
    backend = _RecordingBackend()
    optimizer = _RecordingSGD(model.parameters(), backend)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    parts = StepParts(backend=backend, model=model, train_model=model, optimizer=optimizer, scheduler=schedule,
                      loss_fn=None, sampler=None, train_set=None, epochs=1, global_batch=2, clip_grad_norm=0.5)
    trainer = Trainer(parts, [])
    (model(torch.ones(2, 4)) * 100).sum().backward()
    trainer._last_loss = torch.tensor(1.0)
    trainer.optimizer_step()
    assert optimizer.norms == [pytest.approx(0.5)]
    model.zero_grad()
    (model(torch.ones(2, 4)) * 1e-4).sum().backward()
    before = float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm())
    assert float(clip_gradients(optimizer, 0.5)) == pytest.approx(before)  # below the bound: the norm, untouched
    assert float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()) == pytest.approx(before)


@pytest.mark.horovod
def test_a_clipped_cached_step_on_two_ranks_trains_what_one_process_does(tmp_path):
    config = write_config(tmp_path)
    clip = "optim.clip_grad_norm=0.05"
    # the clipped reference and the same run without the clip, one after the other in one plain process
    one = trace_launch(tmp_path, "one", {"clipped": (config, [clip]), "free": (config, [])}, launcher=None)
    assert one.returncode == 0, one.stdout[-4000:]
    result = launch("horovodrun", SCRIPT, "--config", str(config), "--set", f"workspace={tmp_path / 'two'}",
                    "--set", "train.chunk_size=4", "--set", clip, np=2)
    assert result.returncode == 0, result.stdout[-4000:]
    reference = checkpoint(tmp_path / "one" / "clipped")["model"]
    difference = max_difference(checkpoint(tmp_path / "two")["model"], reference)
    assert difference < 1e-4, difference
    assert max_difference(checkpoint(tmp_path / "one" / "free")["model"], reference) > 100 * max(difference, 1e-7)
