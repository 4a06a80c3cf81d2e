"""The head recipe (issue 37): small rows, their own SGD, a scale from C, a margin ramp, the defaults a head brings,
and what a checkpoint written before it does on resume."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sharded_head import C, D, Member, ThreadGroup, inputs, run_ranks  # noqa: E402

from pksampler.train.config.agreement import check_resume_compatible  # noqa: E402
from pksampler.train.config.load import load_config  # noqa: E402
from pksampler.train.errors import ConfigError  # noqa: E402
from pksampler.train.losses.headed import HeadedLoss  # noqa: E402
from pksampler.train.modeling.model import build_model  # noqa: E402
from pksampler.train.modeling.sharded_head import INIT_STD, ShardedMarginHead, derived_scale  # noqa: E402
from pksampler.train.solver.sparse_rows import SparseRowSGD  # noqa: E402


def test_rows_start_small_and_unnormalised_the_same_at_every_world_size():
    whole = ShardedMarginHead(5000, 64, Member(ThreadGroup(1), 0), seed=3).rows
    norms = whole.norm(dim=-1)
    # N(0, 0.01²) a coordinate: ‖w‖ ≈ 0.01·√64 = 0.08, not 1
    assert abs(float(norms.mean()) - INIT_STD * math.sqrt(64)) < 0.01 and float(norms.max()) < 0.2
    for world in (2, 3):
        parts = [ShardedMarginHead(5000, 64, Member(ThreadGroup(world), rank), seed=3).rows for rank in range(world)]
        assert torch.equal(torch.cat(parts), whole)  # bit for bit, across the 4096-class initialisation blocks
    assert not torch.equal(ShardedMarginHead(5000, 64, Member(ThreadGroup(1), 0), seed=4).rows, whole)


def test_the_scale_is_adacos_bounded_when_not_set():
    assert derived_scale(700) == 10.0  # √2·ln 699 = 9.3, held at the lower bound
    assert derived_scale(10**6) == pytest.approx(math.sqrt(2) * math.log(10**6 - 1))  # 19.5
    assert derived_scale(10**30) == 64.0 and derived_scale(2) == 10.0 and derived_scale(1) == 10.0
    group = Member(ThreadGroup(1), 0)
    assert ShardedMarginHead(C, D, group, scale=None).scale == derived_scale(C)
    assert ShardedMarginHead(C, D, group, scale=12.5).scale == 12.5
    assert load_config(None, ["head.name=arcface"], environ={}).head.scale is None


def test_the_margin_is_zero_in_the_softmax_phase_then_ramps_linearly():
    head = ShardedMarginHead(C, D, Member(ThreadGroup(1), 0), name="cosface", margin=0.4, softmax_steps=10,
                             margin_ramp_steps=4)
    seen = []
    for step in (0, 9, 10, 11, 13, 14, 500):
        head.step = step
        seen.append(head.margin_now())
    assert seen == pytest.approx([0.0, 0.0, 0.1, 0.2, 0.4, 0.4, 0.4])
    # the loss reads it: in the softmax phase cosface is the plain normalised softmax
    embeddings, labels = inputs()
    plain = ShardedMarginHead(C, D, Member(ThreadGroup(1), 0), name="softmax", negatives=10 * C)
    ramped = ShardedMarginHead(C, D, Member(ThreadGroup(1), 0), name="cosface", margin=0.4, negatives=10 * C,
                               softmax_steps=10)
    assert float(ramped(embeddings, labels).detach()) == pytest.approx(float(plain(embeddings, labels).detach()), rel=1e-6)
    ramped.step = 10
    assert float(ramped(embeddings, labels).detach()) > float(plain(embeddings, labels).detach())


def test_a_step_turns_a_small_row_much_further_than_a_unit_row():
    embeddings, labels = inputs()

    def turned(rows_scale: float) -> float:
        def work(group):
            head = ShardedMarginHead(C, D, group, name="softmax", scale=16.0, negatives=10 * C, seed=1)
            head.rows.mul_(rows_scale / float(head.rows.norm(dim=-1).mean()))
            before = torch.nn.functional.normalize(head.rows.clone(), dim=-1)
            optimizer = SparseRowSGD(head, lr=0.1, momentum=0.0)
            head(embeddings, labels).backward()
            optimizer.step(0.01)
            after = torch.nn.functional.normalize(head.rows, dim=-1)
            return float((before * after).sum(-1).clamp(-1, 1).acos().max())
        return run_ranks(1, work)[0]

    small, unit = turned(0.3), turned(1.0)
    assert 0 < unit < 0.05 and small > 5 * unit  # about lr/‖w‖² (11×): the reason the rows start small


def test_from_config_gives_the_rows_their_own_sgd_scaled_with_the_global_batch():
    config = load_config(None, ["head.name=cosface", "head.lr=0.2", "head.momentum=0.8", "head.weight_decay=0.001",
                                "optim.base_batch=64", "head.softmax_steps=5", "head.margin_ramp_steps=7"], environ={})
    loss = HeadedLoss.from_config(config, Member(ThreadGroup(1), 0), torch.nn.Identity(), num_classes=C)
    rows = SparseRowSGD.from_config(config, loss.head, global_batch=128)
    assert rows.lr == pytest.approx(0.4) and rows.momentum == 0.8 and rows.weight_decay == 0.001
    assert loss.head.softmax_steps == 5 and loss.head.margin_ramp_steps == 7
    assert loss.neck is not None  # the BNNeck is on by default with a head
    with pytest.raises(ValueError, match=r"SparseRowSGD\(lr=\) expects a finite number > 0, got 0"):
        SparseRowSGD(loss.head, lr=0)


def test_the_rows_step_on_the_heads_own_loss_whatever_its_weight():
    """head.weight weighs the head against the pair loss in the network's gradient; the rows' step is the same
    at 0.1 as at 1 (before, a weight of 0.1 also ran the rows at a tenth of their rate)."""
    embeddings, labels = inputs()

    def rows_after(weight: float) -> torch.Tensor:
        config = load_config(None, ["head.name=arcface", f"head.weight={weight}", "head.bnneck=false",
                                    f"model.embedding_dim={D}"], environ={})
        loss = HeadedLoss.from_config(config, Member(ThreadGroup(1), 0), lambda e, y: (e * 0).sum(),
                                      num_classes=C)
        assert loss.head.loss_weight == loss.weight == weight
        rows = SparseRowSGD.from_config(config, loss.head, global_batch=64)
        start = loss.head.rows.clone()
        loss(embeddings.clone().requires_grad_(), labels).backward()
        rows.step(0.05)
        assert (loss.head.rows - start).abs().max() > 1e-3  # the step moved them
        return loss.head.rows.clone()

    torch.testing.assert_close(rows_after(0.1), rows_after(1.0), rtol=1e-5, atol=1e-7)


def test_a_head_saved_under_the_weighted_rule_continues_with_its_momentum_in_the_new_units():
    embeddings, labels = inputs()
    head = ShardedMarginHead(C, D, Member(ThreadGroup(1), 0), name="arcface", negatives=10 * C, seed=1)
    old = SparseRowSGD(head, lr=0.1, momentum=0.9)  # before: the rows stepped on head.weight (0.1) x the loss
    (0.1 * head(embeddings, labels)).backward()
    old.step(0.05)
    saved = head.whole_state()
    assert saved.pop("momentum_of_own_loss") is True
    fresh = ShardedMarginHead(C, D, Member(ThreadGroup(1), 0), name="arcface", negatives=10 * C, seed=2,
                              loss_weight=0.1)
    fresh.load_whole(saved)
    torch.testing.assert_close(fresh.momentum, head.momentum / 0.1)
    fresh.load_whole({**saved, "momentum_of_own_loss": True})  # written by this rule: taken as it is
    torch.testing.assert_close(fresh.momentum, head.momentum)


def test_a_head_brings_a_bias_free_projection_and_a_bnneck_unless_set():
    with_head = load_config(None, ["head.name=arcface"], environ={})
    assert with_head.model.projection_bias is False and with_head.head.bnneck is True
    assert build_model(with_head.model).head.bias is None
    without = load_config(None, [], environ={})
    assert without.model.projection_bias is True and without.head.bnneck is False
    assert build_model(without.model).head.bias is not None
    chosen = load_config(None, ["head.name=arcface", "model.projection_bias=true", "head.bnneck=false"], environ={})
    assert chosen.model.projection_bias is True and chosen.head.bnneck is False


def test_the_heads_rules_that_relate_two_keys_are_config_errors():
    with pytest.raises(ConfigError, match=r"^loss.weight: 0.0 weighs the pair loss against the head's"):
        load_config(None, ["loss.weight=0"], environ={})
    with pytest.raises(ConfigError, match=r"^head.name: a sharded head needs train.backward_passes_per_step: 1"):
        load_config(None, ["head.name=arcface", "train.backward_passes_per_step=2"], environ={})


def _earlier(config: dict, *, head: str | None) -> dict:
    """A config as written before the recipe: head.lr_scale, head.scale 30, no projection_bias or pool_norm key."""
    saved = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    saved["head"] = {k: v for k, v in saved["head"].items() if k not in ("lr", "momentum", "weight_decay",
                                                                           "softmax_steps", "margin_ramp_steps")}
    saved["head"].update(name=head, scale=30.0, lr_scale=1.0, bnneck=False)
    saved["model"] = {k: v for k, v in saved["model"].items() if k not in ("projection_bias", "pool_norm")}
    return saved


def test_a_checkpoint_written_before_the_recipe_resumes_without_a_head_and_is_refused_with_one():
    current = load_config(None, [], environ={}).to_dict()
    check_resume_compatible(_earlier(current, head=None), current, "last.pt")  # a headless run continues
    headed = load_config(None, ["head.name=arcface"], environ={}).to_dict()
    with pytest.raises(ConfigError, match=r"its head was trained under the earlier recipe .*head.lr_scale=1.0.* "
                                          r"Start afresh with --no-resume"):
        check_resume_compatible(_earlier(headed, head="arcface"), headed, "last.pt")
    changed = dict(current, model=dict(current["model"], projection_bias=False))
    with pytest.raises(ConfigError, match=r"model.projection_bias"):
        check_resume_compatible(_earlier(current, head=None), changed, "last.pt")
    normed = dict(current, model=dict(current["model"], pool_norm=True))
    with pytest.raises(ConfigError, match=r"model.pool_norm"):
        check_resume_compatible(_earlier(current, head=None), normed, "last.pt")


def test_the_rows_scheduled_step_follows_the_dense_schedule_in_the_trainer(tmp_path):
    from pksampler.train.run_setup import train
    from pksampler.train.runtime.distributed import Backend

    seen: list[float] = []
    original = SparseRowSGD.step

    def spy(self, lr, **kwargs):
        seen.append(lr)
        return original(self, lr, **kwargs)

    tiny = ["data.args={num_classes: 12, images_per_class: 4, image_size: 16}", "data.image_size=16",
            "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "model.width=8",
            "model.depth=[1]", "model.embedding_dim=8", f"workspace={tmp_path / 'run'}", "head.name=arcface",
            "head.lr=0.3", "optim.warmup_steps=4", "train.max_steps=3", "train.tensorboard=false"]
    SparseRowSGD.step = spy
    try:
        train(load_config(None, tiny, environ={}), Backend())
    finally:
        SparseRowSGD.step = original
    # global batch 8 for optim.base_batch 64: 0.3 · 8/64, times the warm-up's (t + 1)/4 that the dense step used
    assert np.allclose(seen, [0.3 * 8 / 64 * f for f in (1 / 4, 2 / 4, 3 / 4)])


def test_under_a_grad_scaler_the_rows_step_on_the_unscaled_gradient_and_skip_an_overflowed_step(tmp_path,
                                                                                               monkeypatch):
    # fp16 (CUDA) scales the loss by the GradScaler's factor: the dense optimizer is unscaled, the rows were not
    # (their SGD stepped on gradients 2**16 times too large). A CPU GradScaler in fp32 shows it: the rows after
    # three steps must be those of the run without a scaler.
    from pksampler.train.run_setup import train
    from pksampler.train.runtime.device import DeviceSetup
    from pksampler.train.runtime.distributed import Backend

    def rows_after(scale: float | None) -> torch.Tensor:
        kept: list[torch.Tensor] = []
        original = SparseRowSGD.step

        def spy(self, *args, **kwargs):
            original(self, *args, **kwargs)
            kept.append(self.head.rows.detach().clone())

        monkeypatch.setattr(SparseRowSGD, "step", spy)
        monkeypatch.setattr(DeviceSetup, "grad_scaler",
                            lambda self: None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale))
        tiny = ["data.args={num_classes: 12, images_per_class: 4, image_size: 16}", "data.image_size=16",
                "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "model.width=8",
                "model.depth=[1]", "model.embedding_dim=8", f"workspace={tmp_path / str(scale)}", "head.name=arcface",
                "optim.warmup_steps=1", "train.max_steps=3", "train.tensorboard=false", "seed=3"]
        train(load_config(None, tiny, environ={}), Backend())
        monkeypatch.setattr(SparseRowSGD, "step", original)
        return kept[-1]

    plain, scaled = rows_after(None), rows_after(2.0 ** 10)
    assert torch.allclose(scaled, plain, rtol=1e-4, atol=1e-6), float((scaled - plain).abs().max())


def test_a_row_step_the_grad_scaler_skipped_moves_no_row_and_decays_none_on_any_rank():
    embeddings, labels = inputs()

    def work(group):
        head = ShardedMarginHead(C, D, group, name="softmax", scale=16.0, negatives=10 * C, seed=1)
        optimizer = SparseRowSGD(head, lr=0.1, weight_decay=0.01)
        before = head.rows.clone()
        (head(embeddings, labels) * float("inf")).backward()
        optimizer.scheduled_step(1.0, grad_scale=2.0 ** 16, skipped=True)
        head.settle()
        return bool(torch.equal(head.rows, before)), head.step, float(head.decay.log[-1])
    assert run_ranks(2, work) == [(True, 1, 0.0), (True, 1, 0.0)]


def test_each_step_record_carries_the_heads_loss_its_margin_free_loss_and_the_margin(tmp_path):
    import json

    from pksampler.train.run_setup import train
    from pksampler.train.runtime.distributed import Backend

    tiny = ["data.args={num_classes: 12, images_per_class: 4, image_size: 16}", "data.image_size=16",
            "data.workers=0", "sampler.classes_per_step=4", "sampler.samples_per_class=2", "model.width=8",
            "model.depth=[1]", "model.embedding_dim=8", f"workspace={tmp_path / 'run'}", "head.name=arcface",
            "head.margin=0.4", "head.softmax_steps=1", "head.margin_ramp_steps=2", "loss.weight=0",
            "train.max_steps=4", "train.tensorboard=false"]
    train(load_config(None, tiny, environ={}), Backend())
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [record for record in map(json.loads, lines) if record["type"] == "step"]
    assert [record["head_margin"] for record in steps] == pytest.approx([0.0, 0.2, 0.4, 0.4])
    assert all(record["head_loss"] == pytest.approx(record["loss"], rel=1e-6) for record in steps)  # head alone
    assert steps[0]["head_softmax_loss"] == pytest.approx(steps[0]["head_loss"], rel=1e-6)  # no margin yet
    assert all(record["head_softmax_loss"] < record["head_loss"] for record in steps[1:])  # the margin adds to it


def test_a_softmax_head_records_no_margin_whatever_head_margin_says():
    head = ShardedMarginHead(C, D, Member(ThreadGroup(1), 0), name="softmax", margin=0.3, negatives=10 * C)
    loss = HeadedLoss(None, head, pair_weight=0)
    loss(*inputs())
    scalars = loss.step_scalars()
    assert scalars["head_margin"] == 0.0  # head.margin's default (0.3) is not applied by the plain softmax
    assert scalars["head_softmax_loss"] == pytest.approx(scalars["head_loss"], rel=1e-6)
