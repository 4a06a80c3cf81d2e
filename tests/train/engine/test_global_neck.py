"""The BatchNorm neck on the gathered global batch (train/engine/global_neck.py), in one process.

What a rank computes is checked by looping over ranks: W ranks that gather
their pre-neck rows and apply the neck with the loss scaled by W (Horovod)
end with one process's gradient and running statistics. The eval-mode
forward is the network's embedding before the change (same tensor names,
same numbers), so checkpoints, export and the catalogue read it unchanged.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn import functional as F

from pksampler.train.engine.cached_step import CachedTrainer, check_chunkable
from pksampler.train.engine.global_neck import GlobalNeck
from pksampler.train.engine.trainer import StepParts, Trainer
from pksampler.train.errors import ConfigError
from pksampler.train.losses.pair import build_loss
from pksampler.train.modeling.model import EmbeddingNet, global_neck, norm_factory
from pksampler.train.runtime.distributed import Backend
from pksampler.world import World

#: the neck's tensors as checkpoints written before the neck moved to the step name them
SAVED_NECK = {"neck.weight", "neck.bias", "neck.running_mean", "neck.running_var", "neck.num_batches_tracked"}


def _net(neck: str = "batch") -> EmbeddingNet:
    torch.manual_seed(0)
    return EmbeddingNet(8, (1, 1), 16, norm_factory("group"), neck=neck)


def _batch(size: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(size, 3, 12, 12, generator=generator), torch.arange(size) // 4


def _old_forward(model: EmbeddingNet, images: torch.Tensor) -> torch.Tensor:
    """The embedding as the network computed it before: the neck inside the forward pass."""
    return F.normalize(model.neck(model.head(model.pool(model.stages(model.stem(images))))), dim=1)


def test_train_mode_stops_before_the_neck_and_eval_mode_embeds_as_before():
    model = _net()
    assert global_neck(model) is model.neck and global_neck(_net("layer")) is None and global_neck(_net("none")) is None
    images, _ = _batch(6)
    features = model.train()(images)
    assert features.shape == (6, 16) and not torch.allclose(features.norm(dim=1), torch.ones(6))
    model.neck.running_mean.normal_()  # statistics a run would have left
    model.neck.running_var.uniform_(0.5, 2.0)
    model.eval()
    alone = torch.cat([model(images[i:i + 1]) for i in range(6)])  # one image at a time, running statistics
    assert torch.allclose(alone, _old_forward(model, images), atol=1e-6)
    assert torch.allclose(alone.norm(dim=1), torch.ones(6), atol=1e-6)


def test_checkpoints_written_before_the_change_load_with_their_names():
    model = _net()
    assert SAVED_NECK <= set(model.state_dict())
    saved = {k: v.clone() for k, v in _net().state_dict().items()}
    saved["neck.running_mean"] += 0.5
    fresh = _net()
    global_neck(fresh)
    fresh.load_state_dict(saved)  # strict: no name added, none missing
    assert torch.equal(fresh.neck.running_mean, saved["neck.running_mean"])


def _parts(model, loss_fn, backend=None) -> StepParts:
    backend = backend or Backend()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    neck = GlobalNeck.of(model, lambda: backend.gathered_loss_scale)
    return StepParts(backend=backend, model=model, train_model=model, optimizer=optimizer,
                     scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), loss_fn=loss_fn,
                     sampler=None, train_set=None, epochs=1, global_batch=48, gather=False, neck=neck)


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    """Every gradient within 1e-5 of its norm (the projection's bias, whose gradient the neck cancels, within
    float noise: 1e-6, against gradients of norm 0.05-2)."""
    return all(float((got[k] - want[k]).norm()) <= 1e-5 * float(want[k].norm()) + 1e-6 for k in want)


def test_the_step_trains_what_the_neck_inside_the_forward_pass_trained_in_one_process():
    images, labels = _batch()
    loss_fn = build_loss("multi_similarity", {})
    reference = _net()
    loss_fn(_old_forward(reference.train(), images), labels).backward()
    stepped = _net()
    Trainer(_parts(stepped, loss_fn), []).forward_backward(images, labels, reduce=True)
    want, got = _gradients(reference), _gradients(stepped)
    assert _close(got, want)
    assert torch.equal(stepped.neck.running_mean, reference.neck.running_mean)


def test_ranks_that_gather_their_rows_hold_one_process_gradient_of_the_neck():
    # Horovod: the gathered loss is scaled by W and the optimizer averages; the neck's hook divides by W.
    images, labels = _batch()
    loss_fn = build_loss("multi_similarity", {})
    one = _net()
    neck = GlobalNeck(one, lambda: 1.0)
    global_neck(one)
    loss_fn(neck(one.train()(images)), labels).backward()
    world, ranks = 3, []
    for rank in range(world):
        model = _net()
        global_neck(model)
        scaled = GlobalNeck(model, lambda: float(world))
        rows = torch.cat([model.train()(images[r * 16:(r + 1) * 16]) if r == rank
                          else model(images[r * 16:(r + 1) * 16]).detach() for r in range(world)])
        (world * loss_fn(scaled(rows), labels)).backward()
        ranks.append(model.neck.weight.grad.clone())
    averaged = torch.stack(ranks).mean(dim=0)
    assert torch.allclose(averaged, one.neck.weight.grad, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(averaged * world, one.neck.weight.grad, rtol=1e-2)  # the scale would show


def test_gradient_cached_steps_apply_the_neck_to_the_whole_batch():
    images, labels = _batch()
    loss_fn = build_loss("multi_similarity", {})
    results = []
    for trainer_class, kwargs in ((Trainer, {}), (CachedTrainer, {"chunk_size": 10})):  # uneven chunks
        model = _net()
        parts = _parts(model, copy.deepcopy(loss_fn))
        check_chunkable(model, kwargs.get("chunk_size"), apart=parts.neck.module)  # the neck may stay
        trainer_class(parts, [], **kwargs).forward_backward(images, labels, reduce=True)
        results.append((_gradients(model), model.neck.running_var.clone()))
    (want, want_var), (got, got_var) = results
    assert _close(got, want)
    assert torch.allclose(got_var, want_var) and model.neck.num_batches_tracked == 1  # once per step
    with pytest.raises(ConfigError, match=r"BatchNorm layers in train mode \(neck, 1 in all\)"):
        check_chunkable(_net(), 10)  # a neck inside the chunks' forward pass would see a chunk


def test_the_neck_needs_two_rows():
    model = _net()
    neck = GlobalNeck.of(model, lambda: 1.0)
    with pytest.raises(ValueError, match="model.neck: 'batch' normalises over the global batch and needs at least 2"):
        neck(torch.randn(1, 16))


class _HorovodLike(Backend):
    """Horovod's rule without Horovod: the gathered loss is multiplied by the world size."""

    scales_gathered_loss = True


class _Share:
    """A sampler stand-in: it takes the new world and nothing else."""

    def set_world(self, world: World) -> None:
        self.world = world


def test_the_necks_gradient_divisor_follows_the_world_after_a_reset():
    # Horovod elastic: a job started on 2 ranks grows to 4 (a join) and shrinks to 3 (a leave), and a rollback
    # loads the committed state into the same parameters; each time the neck's gradient, computed whole on every
    # rank with the loss scaled by the new W, must be one process's again (a divisor read once would stay 2).
    images, labels = _batch()
    loss_fn = build_loss("multi_similarity", {})
    one = _net()
    GlobalNeck.of(one, lambda: 1.0)
    loss_fn(one.finish(one.train()(images)), labels).backward()
    want = one.neck.weight.grad.clone()
    backend = _HorovodLike("cpu", "fp32")
    backend.set_world(World(rank=0, size=2))
    model = _net()
    parts = _parts(model, loss_fn, backend)
    parts.sampler = _Share()
    trainer = Trainer(parts, [])
    saved = copy.deepcopy(model.state_dict())
    for world in (World(rank=1, size=4), World(rank=0, size=3)):
        trainer.set_world(world)
        model.load_state_dict(saved)  # what Horovod's restore does: the same parameter objects, their hooks kept
        model.zero_grad()
        (backend.gathered_loss_scale * loss_fn(parts.neck(model.train()(images)), labels)).backward()
        assert backend.gathered_loss_scale == world.size
        assert torch.allclose(model.neck.weight.grad, want, rtol=1e-5, atol=1e-7), world
