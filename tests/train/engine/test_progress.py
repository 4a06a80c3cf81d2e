"""Progress: exact plain lines and their cadence with a fake clock; the tqdm bar in a terminal."""

from __future__ import annotations

import io
import sys

import pytest
import torch

from pksampler.train.engine.progress import Progress, format_eta


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_epochs(progress: Progress, clock: FakeClock, epochs: range, steps: int, seconds_per_step: float,
               start_step: int = 0) -> None:
    for epoch in epochs:
        progress.start_epoch(epoch, step=start_step)
        for step in range(start_step + 1, steps + 1):
            clock.now += seconds_per_step
            progress.update(step, loss=1.0 / step, images_per_sec=64.0 / seconds_per_step, lr=0.001 * step)
        progress.end_epoch()
        start_step = 0
    progress.close()


def test_plain_lines_every_n_steps_with_exact_format_and_eta():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(20, 2, interactive=False, every_steps=5, every_seconds=None, stream=out, clock=clock)
    run_epochs(progress, clock, range(2), 20, 1.0)
    lines = out.getvalue().splitlines()
    assert len(lines) == 8  # steps 5, 10, 15, 20 of both epochs; end_epoch adds no duplicate
    assert lines[0] == "[pksampler] epoch 1/2 step 5/20 loss 0.2000 img/s 64.0 lr 0.005 eta 0:00:35"
    assert lines[3] == "[pksampler] epoch 1/2 step 20/20 loss 0.0500 img/s 64.0 lr 0.02 eta 0:00:20"
    assert lines[4].startswith("[pksampler] epoch 2/2 step 5/20 ")
    assert lines[-1].endswith("eta 0:00:00")


def test_the_eta_counts_to_the_step_the_run_stops_at():
    # train.max_steps=12 in a schedule of 2 epochs of 20: the eta is to step 12, not to step 40
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(20, 2, interactive=False, every_steps=5, every_seconds=None, stream=out, clock=clock,
                        stop_at=12)
    progress.start_epoch(0)
    for step in range(1, 13):
        clock.now += 1.0
        progress.update(step, loss=1.0)
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[pksampler] epoch 1/2 step 5/20 loss 1.0000 eta 0:00:07"
    assert lines[-1] == "[pksampler] epoch 1/2 step 12/20 loss 1.0000 eta 0:00:00"
    assert Progress(20, 2, stop_at=100).last_position == 40  # past the schedule's end: the schedule's end


@pytest.mark.parametrize(("max_steps", "batches", "passes", "expected"),
                         [(None, 20, 1, None), (12, 20, 1, 12), (0, 20, 1, 0), (10, 20, 2, 20), (11, 20, 2, 22),
                          (4, 7, 2, 7), (5, 7, 2, 9)])
def test_max_steps_is_the_batch_the_progress_line_counts_to(max_steps, batches, passes, expected):
    # train.backward_passes_per_step: an optimizer step is `passes` batches, an epoch's last step perhaps fewer
    # (7 batches in 2-batch steps: 4 steps, the last of one batch)
    from pksampler.train.run_setup import stop_batch

    assert stop_batch(max_steps, batches, passes) == expected


def test_plain_lines_every_n_seconds_and_at_the_last_step():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(7, 1, interactive=False, every_steps=100, every_seconds=30, stream=out, clock=clock)
    run_epochs(progress, clock, range(1), 7, 10.0)
    steps = [line.split()[4] for line in out.getvalue().splitlines()]
    assert steps == ["3/7", "6/7", "7/7"]  # 30 s after the start, 30 s later, and the epoch's last step


def test_default_cadence_is_ten_percent_of_an_epoch():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(95, 1, interactive=False, stream=out, clock=clock)
    assert progress.every_steps == 10
    run_epochs(progress, clock, range(1), 95, 0.01)
    steps = [int(line.split()[4].split("/")[0]) for line in out.getvalue().splitlines()]
    assert steps == [10, 20, 30, 40, 50, 60, 70, 80, 90, 95]


def test_epoch_cut_short_prints_its_last_state_once_and_resume_counts_from_the_resumed_step():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(10, 3, interactive=False, every_steps=4, every_seconds=None, stream=out, clock=clock)
    progress.start_epoch(1, step=6)  # resumed in the middle of the second epoch
    for step in (7, 8, 9):
        clock.now += 2.0
        progress.update(step, loss=torch.tensor(0.25))
    progress.end_epoch()
    progress.close()
    lines = out.getvalue().splitlines()
    # nothing due at 7 or 8 (4 steps after 6 is 10): end_epoch prints step 9 once;
    # rate 3 steps / 6 s, remaining 1 + 10 steps -> 22 s
    assert lines == ["[pksampler] epoch 2/3 step 9/10 loss 0.2500 eta 0:00:22"]


def test_interactive_mode_draws_a_tqdm_bar_and_no_plain_lines():
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(4, 2, interactive=True, stream=out, clock=clock)
    run_epochs(progress, clock, range(2), 4, 1.0)
    text = out.getvalue()
    assert "[pksampler]" not in text
    assert "epoch 1/2" in text and "epoch 2/2" in text
    assert "4/4" in text and "loss=0.2500" in text and "img_s=64.0" in text


def test_interactive_none_follows_stderr_isatty(monkeypatch):
    class Pipe(io.StringIO):
        def isatty(self) -> bool:
            return False

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Pipe())
    assert Progress(3, 1).interactive is False
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert Progress(3, 1).interactive is True


def test_plain_mode_defaults_to_stdout_and_write_passes_messages(capsys):
    clock = FakeClock()
    progress = Progress(2, 1, interactive=False, clock=clock)
    progress.start_epoch(0)
    clock.now += 1.0
    progress.update(2, loss=0.5)
    progress.write("[pksampler] epoch 1: recall_at_1=0.9000")
    progress.close()
    captured = capsys.readouterr()
    assert captured.out.splitlines() == ["[pksampler] epoch 1/1 step 2/2 loss 0.5000 eta 0:00:00",
                                         "[pksampler] epoch 1: recall_at_1=0.9000"]
    assert captured.err == ""


@pytest.mark.parametrize("interactive", [True, False])
def test_disabled_progress_writes_nothing(interactive):
    out = io.StringIO()
    progress = Progress(3, 1, enabled=False, interactive=interactive, stream=out)
    run_epochs(progress, FakeClock(), range(1), 3, 1.0)
    progress.write("hello")
    assert out.getvalue() == ""


def test_format_eta():
    assert format_eta(72.4) == "0:01:12"
    assert format_eta(3 * 3600 + 5) == "3:00:05"
    assert format_eta(float("nan")) == "?"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"steps_per_epoch": 0}, r"Progress\(steps_per_epoch=\) must be a positive int, got 0"),
        ({"epochs": True}, r"Progress\(epochs=\) must be a positive int, got True"),
        ({"every_steps": 0}, r"Progress\(every_steps=\) must be a positive int or None, got 0"),
        ({"every_seconds": -1}, r"Progress\(every_seconds=\) must be a positive number or None, got -1"),
        ({"stop_at": -1}, r"Progress\(stop_at=\) must be an int >= 0 or None, got -1"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"steps_per_epoch": 5, "epochs": 2}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Progress(args.pop("steps_per_epoch"), args.pop("epochs"), **args)


def test_through_a_pipe_the_default_is_plain_lines_on_stdout():
    """As under horovodrun or CI: stderr is a pipe, so no bar redraws, only flushed lines."""
    import subprocess

    script = (
        "from pksampler.train.engine.progress import Progress\n"
        "p = Progress(4, 1, every_steps=2)\n"
        "p.start_epoch(0)\n"
        "for s in range(1, 5): p.update(s, loss=0.5)\n"
        "p.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(" eta ")[0] for line in lines] == [
        "[pksampler] epoch 1/1 step 2/4 loss 0.5000", "[pksampler] epoch 1/1 step 4/4 loss 0.5000"]
    assert done.stderr == ""
