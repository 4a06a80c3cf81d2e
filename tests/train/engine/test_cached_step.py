"""Gradient-cached steps (``train.chunk_size``) give the gradients of the whole global batch.

One process, a 4,096-image global step: the plain :class:`Trainer` step over
the whole batch against :class:`CachedTrainer` in chunks, for every built-in
loss, a pytorch-metric-learning loss with its miner and cross-batch memory.
The network has dropout, so the second pass only matches when the RNG is
replayed. The real multi-rank runs are in tests/distributed/test_cached_step.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from pksampler.train.config.load import load_config
from pksampler.train.engine.cached_step import CachedTrainer, check_chunkable
from pksampler.train.engine.trainer import StepParts, Trainer
from pksampler.train.errors import ConfigError
from pksampler.train.losses.memory import build_memory
from pksampler.train.losses.pair import build_loss
from pksampler.train.modeling.model import EmbeddingNet, build_model, norm_factory
from pksampler.train.runtime.distributed import Backend

IMAGES, SIDE = 4096, 6


class Dropped(torch.nn.Module):
    """The demo network with dropout before the head: a second pass matches only with the RNG replayed."""

    def __init__(self, norm: str = "group") -> None:
        super().__init__()
        self.net = EmbeddingNet(8, (1,), 16, norm_factory(norm))
        self.drop = torch.nn.Dropout(0.2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.drop(self.net(images)), dim=1)


def batch(layout: str = "pk", size: int = IMAGES) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` images of ``size / 4`` classes, 4 each (P×K), or rows (anchor, positive, negative)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(size, 3, SIDE, SIDE, generator=generator)
    if layout == "triplet":
        anchors = torch.arange(size // 3) % (size // 4)
        labels = torch.stack([anchors, anchors, (anchors + 1) % (size // 4)], dim=1).flatten()
        return images[: labels.numel()], labels
    return images, torch.arange(size) // 4


def parts(model: torch.nn.Module, loss_fn) -> StepParts:
    optimizer = torch.optim.SGD(list(model.parameters()) + list(loss_fn.parameters()), lr=0.1)
    return StepParts(backend=Backend(), model=model, train_model=model, optimizer=optimizer,
                     scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), loss_fn=loss_fn,
                     sampler=None, train_set=None, epochs=1, global_batch=IMAGES, gather=False)


def gradients(trainer_class, model, loss_fn, images, labels, **kwargs) -> list[torch.Tensor]:
    model, loss_fn = copy.deepcopy(model), copy.deepcopy(loss_fn)
    torch.manual_seed(7)  # the dropout masks of the step
    trainer = trainer_class(parts(model, loss_fn), [], **kwargs)
    trainer.forward_backward(images, labels, reduce=True)
    return [p.grad.clone() for p in model.parameters()] + [p.grad.clone() for p in loss_fn.parameters()]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).norm() / w.norm().clamp_min(1e-12)) for g, w in zip(got, want))


#: global batch per loss: the 4,096-image step for multi-similarity, 1,024 or 512 images for the others, whose
#: cost (all pairs, mined triplets) grows with the square of the batch and is not what is tested here
SIZES = {name: 1024 for name in ("batch_hard", "contrastive", "triplet", "multi_similarity + memory",
                                 "pml.ArcFaceLoss (own parameters)")} | {"pml.TripletMarginLoss + miner": 512}

LOSSES = {
    "batch_hard": lambda: build_loss("batch_hard", {"margin": 0.2}),
    "multi_similarity": lambda: build_loss("multi_similarity", {}),
    "contrastive": lambda: build_loss("contrastive", {}),
    "triplet": lambda: build_loss("triplet", {}),
    "pml.TripletMarginLoss + miner": lambda: build_loss("pml.TripletMarginLoss", {"margin": 0.1},
                                                        miner={"name": "pml.MultiSimilarityMiner", "args": {"epsilon": 0.1}}),
    "pml.ArcFaceLoss (own parameters)": lambda: build_loss("pml.ArcFaceLoss", {"num_classes": 256,
                                                                               "embedding_size": 16}),
    "multi_similarity + memory": lambda: build_loss("multi_similarity", {},
                                                    memory=build_memory({"size": 2, "warmup_steps": 0})),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_chunked_gradients_equal_the_whole_batch(name):
    torch.manual_seed(0)
    model, loss_fn = Dropped(), LOSSES[name]()
    images, labels = batch("triplet" if name == "triplet" else "pk", SIZES.get(name, IMAGES))
    if "memory" in name:  # a memory that already holds a batch, so the references take part
        loss_fn(torch.nn.functional.normalize(torch.randn(labels.numel(), 16), dim=1), labels)
    want = gradients(Trainer, model, loss_fn, images, labels)
    got = gradients(CachedTrainer, model, loss_fn, images, labels, chunk_size=300)  # uneven chunks
    print(f"{name}: {labels.numel()} images, max relative error {relative_error(got, want):.2e}")
    assert relative_error(got, want) <= 1e-5, name


def test_the_memory_is_filled_once_per_step_as_in_the_plain_step():
    torch.manual_seed(0)
    model, memory_loss = Dropped(), LOSSES["multi_similarity + memory"]()
    images, labels = batch()
    plain, cached = copy.deepcopy(memory_loss), copy.deepcopy(memory_loss)
    Trainer(parts(copy.deepcopy(model), plain), []).forward_backward(images, labels, reduce=True)
    CachedTrainer(parts(copy.deepcopy(model), cached), [], chunk_size=1000).forward_backward(images, labels,
                                                                                             reduce=True)
    saved_plain, saved_cached = plain.state_dict(), cached.state_dict()
    assert saved_plain.keys() == saved_cached.keys()
    for key in saved_plain:
        if torch.is_tensor(saved_plain[key]):
            assert torch.allclose(saved_plain[key], saved_cached[key], atol=1e-6), key


def test_without_the_rng_replayed_dropout_would_break_the_gradient():
    """The replay matters: the same chunks with fresh dropout masks in the second pass give another gradient."""
    torch.manual_seed(0)
    model, loss_fn = Dropped(), LOSSES["multi_similarity"]()
    images, labels = batch()
    want = gradients(Trainer, model, loss_fn, images, labels)

    class NoReplay(CachedTrainer):
        def _embed(self, images, chunks):
            embeddings, states = super()._embed(images, chunks)
            fresh = []
            for number in range(len(states)):
                torch.manual_seed(1000 + number)  # other dropout masks than the first pass drew
                fresh.append((torch.get_rng_state(), []))
            return embeddings, fresh

    assert relative_error(gradients(NoReplay, model, loss_fn, images, labels, chunk_size=500), want) > 1e-3


def test_batch_norm_in_train_mode_is_refused_and_would_have_been_wrong():
    config = load_config(None, ["model.norm=batch", "train.chunk_size=64", "model.width=8", "model.depth=[1]"],
                         environ={})
    model = build_model(config.model)
    with pytest.raises(ConfigError, match=r"^train.chunk_size=64: the model has BatchNorm layers in train mode "
                                          r"\(stem.1, .*set model.norm: group"):
        check_chunkable(model, config.train.chunk_size)
    check_chunkable(model, None)  # no chunking: nothing to refuse
    frozen = build_model(load_config(None, ["model.norm=batch", "model.freeze_norm=true", "model.width=8",
                                            "model.depth=[1]"], environ={}).model)
    check_chunkable(frozen, 64)  # frozen statistics are per image
    # What it would have computed: BatchNorm's chunk statistics are not the batch's.
    torch.manual_seed(0)
    bn_model, loss_fn = Dropped(norm="batch"), LOSSES["multi_similarity"]()
    images, labels = batch()
    want = gradients(Trainer, bn_model, loss_fn, images, labels)
    assert relative_error(gradients(CachedTrainer, bn_model, loss_fn, images, labels, chunk_size=500), want) > 1e-2


def test_chunk_size_is_checked():
    with pytest.raises(ConfigError, match=r"train.chunk_size: must be an integer >= 1, got 0"):
        load_config(None, ["train.chunk_size=0"], environ={})
    with pytest.raises(ValueError, match=r"CachedTrainer\(chunk_size=\) expects a positive int, got True"):
        CachedTrainer(parts(Dropped(), LOSSES["contrastive"]()), [], chunk_size=True)


def test_a_chunked_run_resumed_mid_epoch_ends_where_an_uninterrupted_one_does(tmp_path):
    from pksampler.train.engine.checkpoint import load_checkpoint
    from pksampler.train.run_setup import train

    def run(workspace: str, steps: int) -> None:
        config = load_config(None, [
            "data.args={num_classes: 16, images_per_class: 4, image_size: 24}", "data.image_size=16",
            "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "train.chunk_size=3",
            "model.width=8", "model.depth=[1]", "train.epochs=1", f"train.max_steps={steps}",
            "train.checkpoint_every=0", "train.tensorboard=false", "train.eval_every=100",
            f"workspace={tmp_path / workspace}"], environ={})
        train(config, Backend())

    run("straight", 4)
    run("resumed", 2)
    run("resumed", 4)
    straight = load_checkpoint(tmp_path / "straight" / "checkpoints" / "last.pt")
    resumed = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "last.pt")
    assert straight["state"]["global_step"] == resumed["state"]["global_step"] == 4
    assert all(torch.equal(straight["model"][k], resumed["model"][k]) for k in straight["model"])


def test_the_products_config_is_chunkable_as_shipped():
    """configs/products.yaml: ResNet-50 from pretrained weights (frozen BatchNorm), G = 1,024, K = 4, chunks of 128."""
    from launch import ROOT

    config = load_config(ROOT / "configs" / "products.yaml", environ={})
    assert (config.sampler.classes_per_step, config.sampler.samples_per_class, config.train.chunk_size) == (1024, 4, 128)
    with torch.device("meta"):
        model = build_model(config.model, image_size=config.data.image_size)
    check_chunkable(model, config.train.chunk_size)


def test_chunked_steps_with_the_sharded_head_train_what_whole_steps_train(tmp_path):
    """The head's gradient with respect to the embeddings is cached like the pair loss's: the model, the head's
    rows and their momentum after 3 chunked steps equal those of 3 whole steps."""
    from pksampler.train.engine.checkpoint import load_checkpoint
    from pksampler.train.losses.headed import whole_loss_state
    from pksampler.train.modeling.range_checkpoint import located
    from pksampler.train.run_setup import train

    def run(workspace: str, *extra: str) -> dict:
        config = load_config(None, [
            "data.args={num_classes: 16, images_per_class: 4, image_size: 24}", "data.image_size=16",
            "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "model.width=8",
            "model.depth=[1]", "head.name=arcface", "head.negatives=4", "optim.name=sgd", "optim.lr=0.05",
            "train.epochs=1", "train.max_steps=3", "train.checkpoint_every=0", "train.tensorboard=false",
            "train.eval_every=100", f"workspace={tmp_path / workspace}", *extra], environ={})
        train(config, Backend())
        path = tmp_path / workspace / "checkpoints" / "last.pt"
        state = located(load_checkpoint(path), path)
        return {**state, "loss": whole_loss_state(state["loss"])}  # the rows from their range files

    whole, chunked = run("whole"), run("chunked", "train.chunk_size=3")
    for key, want in whole["model"].items():
        assert torch.allclose(chunked["model"][key], want, rtol=1e-5, atol=1e-6), key
    head_whole, head_chunked = whole["loss"]["head"], chunked["loss"]["head"]
    for key, want in head_whole.items():
        if isinstance(want, torch.Tensor) and want.is_floating_point():
            # float32 sums in another order: the error is relative to the tensor's scale (the small rows' momentum
            # reaches ~10, since a normalised row's gradient grows as 1/|w|)
            scale = float(want.abs().max()) if want.numel() else 0.0
            assert torch.allclose(head_chunked[key], want, rtol=1e-5, atol=max(1e-6, 1e-5 * scale)), key
    assert head_whole["momentum"].abs().sum() > 0  # the rows did move
