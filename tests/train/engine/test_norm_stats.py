"""BatchNorm running statistics are averaged over the ranks after each epoch (Horovod copies none of them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from test_sharded_head import run_ranks  # noqa: E402

from pksampler.train.config.load import load_config  # noqa: E402
from pksampler.train.engine.norm_stats import NormStatisticsHook, running_statistics  # noqa: E402
from pksampler.train.engine.trainer import TrainingDiverged  # noqa: E402
from pksampler.train.modeling.model import build_model  # noqa: E402
from pksampler.world import World  # noqa: E402


def _model(neck: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = load_config(None, [f"model.neck={neck}", "model.width=8", "model.depth=[1]", "model.norm=group"],
                         environ={})
    return build_model(config.model)


def hook(model: torch.nn.Module, collectives) -> NormStatisticsHook:
    return NormStatisticsHook(model, lambda t: collectives.allreduce_sum(t) / collectives.size,
                              lambda: World(collectives.rank, collectives.size))


def test_each_rank_ends_the_epoch_with_the_mean_of_every_ranks_statistics():
    def work(collectives):
        model = _model("batch").train()
        generator = torch.Generator().manual_seed(collectives.rank)
        model(torch.randn(8, 3, 16, 16, generator=generator) + 3 * collectives.rank)  # each rank its own batch
        own = [buffer.clone() for buffer in running_statistics(model)]
        hook(model, collectives).after_epoch()
        return own, [buffer.clone() for buffer in running_statistics(model)]

    (own0, after0), (own1, after1) = run_ranks(2, work)
    assert len(after0) == 2 and not torch.allclose(own0[0], own1[0])  # the neck's mean and variance differed
    for a, b, x, y in zip(after0, after1, own0, own1):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, (x + y) / 2)


def test_a_model_without_running_statistics_has_none_to_average():
    assert running_statistics(_model("none")) == [] and running_statistics(_model("layer")) == []


@pytest.mark.parametrize("world", [2, 3])
def test_one_ranks_non_finite_statistics_stop_every_rank_naming_it_before_they_are_averaged(world):
    """Before: rank 1's NaN running variance was averaged into every rank, and no stop named it."""
    def work(collectives):
        model = _model("batch").train()
        model(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(collectives.rank)))
        name, buffer = next((n, b) for n, b in model.named_buffers() if n.endswith("running_var"))
        if collectives.rank == 1:
            buffer[3] = float("inf") if world == 3 else float("nan")
        own = [b.clone() for b in running_statistics(model)]
        with pytest.raises(TrainingDiverged) as stop:
            hook(model, collectives).after_epoch()
        unchanged = all(torch.equal(a, b) | (a.isnan().any() and b.isnan().any())
                        for a, b in zip(own, running_statistics(model)))
        return str(stop.value), name, unchanged

    results = run_ranks(world, work)
    message, name, _ = results[0]
    assert all(result == (message, name, True) for result in results), results
    assert message.startswith(f"rank 1's BatchNorm running statistic {name} holds NaN or infinite values at the end "
                              f"of the epoch (1 of {world} ranks); nothing was averaged"), message
    assert "optim.lr" not in message and "that rank's data" in message


def test_finite_statistics_whose_sum_overflows_stop_every_rank_instead_of_becoming_infinite():
    """Before: each rank's running variance was finite (3e38), their all-reduced sum was inf, and every rank's
    statistics became inf without a stop (evaluation and the checkpoint then read them)."""
    def work(collectives):
        model = _model("batch").train()
        model(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(collectives.rank)))
        name, buffer = next((n, b) for n, b in model.named_buffers() if n.endswith("running_var"))
        buffer[2] = 3e38
        own = [b.clone() for b in running_statistics(model)]
        with pytest.raises(TrainingDiverged) as stop:
            hook(model, collectives).after_epoch()
        return str(stop.value), name, all(torch.equal(a, b) for a, b in zip(own, running_statistics(model)))

    results = run_ranks(2, work)
    message, name, _ = results[0]
    assert all(result == (message, name, True) for result in results), results
    assert message.startswith(f"BatchNorm running statistic {name} is finite on every rank but its mean over the 2 "
                              "ranks is not"), message


def test_the_hook_is_built_at_one_rank_so_a_world_that_grows_averages_and_one_rank_keeps_its_own(tmp_path):
    """Before: built only when the run started on more than one rank, so a Horovod elastic run that started on
    one rank and grew never averaged its statistics."""
    from pksampler.train.engine.elastic import HorovodElasticMode
    from pksampler.train.run_setup import assemble
    from pksampler.train.runtime.distributed import Backend

    tiny = ["data.args={num_classes: 12, images_per_class: 4, image_size: 16}", "data.image_size=16",
            "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "model.width=8",
            "model.depth=[1]", "model.embedding_dim=8", "model.norm=batch", f"workspace={tmp_path / 'run'}",
            "train.max_steps=2", "train.tensorboard=false"]
    backend = Backend()
    run = assemble(load_config(None, tiny, environ={}), backend, mode=HorovodElasticMode(backend, commit_every=1))
    try:
        (built,) = [h for h in run.trainer.hooks if isinstance(h, NormStatisticsHook)]
        model = run.trainer.parts.model.train()
        model(torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(0)))
        own = [buffer.clone() for buffer in running_statistics(model)]
        built.after_epoch()  # one rank: the mean over the ranks is its own statistics, bit for bit
        assert own and all(torch.equal(a, b) for a, b in zip(own, running_statistics(model)))
        assert built.world() == backend.world  # read live: a reset's new world is the one it averages over
        from pksampler.world import World

        backend.set_world(World(rank=1, size=3, local_rank=1, local_size=3))
        assert built.world().size == 3 and built.world().rank == 1
    finally:
        run.close()
