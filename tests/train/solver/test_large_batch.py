"""Large global batches: the learning-rate rule per optimizer, the warm-up share, LAMB and LARS.

The optimizers' steps are checked twice: against the papers' formulas
written out here in float64 (one and two steps, so the moments and the
momentum count), and against timm's ``Lamb``/``Lars`` over several steps
(the implementations people use; timm is imported without a working
torchvision, as the backbone parity tests do).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from pksampler.train.builders import build_data, build_optimizer, build_sampler, build_schedule, warmup_length
from pksampler.train.config.load import ConfigError, load_config
from pksampler.train.run_setup import train
from pksampler.train.runtime.distributed import Backend
from pksampler.train.solver.build import DEFAULT_SCALING, OPTIMIZERS, learning_rate, scaled_lr, scaling_rule
from pksampler.train.solver.layerwise import Lamb, Lars
from tiny_runs import TINY as SHARED_TINY

TINY = [*SHARED_TINY, "optim.base_batch=3"]


def _config(*extra: str):
    return load_config(None, [*TINY, *extra], environ={})


# ---- the batch-size rules ------------------------------------------------------------------------------


def test_the_three_rules_move_the_rate_by_the_batch_ratio_to_the_power_one_half_or_zero():
    assert scaled_lr(0.1, 1024, 256, "linear") == pytest.approx(0.4)
    assert scaled_lr(0.004, 1024, 64, "sqrt") == pytest.approx(0.016)
    assert scaled_lr(0.004, 1024, 64, "none") == 0.004
    assert scaled_lr(0.004, 16, 64, "sqrt") == pytest.approx(0.002)  # smaller batches go down by the same rule
    with pytest.raises(ValueError, match=r"optim.scaling: expected one of linear, sqrt, none here, got 'auto'"):
        scaled_lr(0.1, 2, 1, "auto")


@pytest.mark.parametrize(("name", "rule"), [("adamw", "sqrt"), ("lamb", "sqrt"), ("sgd", "linear"), ("lars", "linear")])
def test_auto_picks_the_optimizers_own_rule_and_an_explicit_rule_wins(name, rule):
    optim = _config(f"optim.name={name}").optim
    assert optim.scaling == "auto" and scaling_rule(optim) == rule
    factor = {"sqrt": 2.0, "linear": 4.0}[rule]  # 12 images per step against base_batch 3
    assert learning_rate(optim, 12) == pytest.approx(0.003 * factor)
    assert learning_rate(_config(f"optim.name={name}", "optim.scaling=none").optim, 12) == pytest.approx(0.003)


def test_every_optimizer_has_a_default_rule():
    assert set(DEFAULT_SCALING) == set(OPTIMIZERS) and set(DEFAULT_SCALING.values()) <= {"linear", "sqrt"}


@pytest.mark.parametrize(("override", "message"), [
    ("optim.scaling=cubic", r"optim.scaling: must be one of \['auto', 'linear', 'sqrt', 'none'\], got 'cubic'"),
    ("optim.warmup_fraction=1.5", r"optim.warmup_fraction: .*1.5"),
    ("optim.name=lion", r"optim.name: must be one of \[.*'lamb', 'lars'\], got 'lion'"),
])
def test_bad_values_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        _config(override)


def test_an_infinite_rate_names_the_rule_that_made_it():
    with pytest.raises(ConfigError, match=r"optim.lr: 1e\+308 x 12 images per step / optim.base_batch=1 gives the "
                                          r"learning rate inf, .*optim.scaling: linear, 'auto'"):
        _config("optim.name=lars", "optim.lr=1e308", "optim.base_batch=1")
    _config("optim.name=lars", "optim.lr=1e308", "optim.base_batch=1", "optim.scaling=none")  # no scaling: finite


# ---- the warm-up in proportion to the run -------------------------------------------------------------


def test_warmup_fraction_is_a_share_of_the_run_and_warmup_steps_still_works():
    assert warmup_length(_config().optim, 1000) == 3  # warmup_steps as before
    assert warmup_length(_config("optim.warmup_fraction=0.05").optim, 1000) == 50
    assert warmup_length(_config("optim.warmup_fraction=0.05").optim, 300) == 15
    assert warmup_length(_config("optim.warmup_fraction=1.0").optim, 7) == 7
    assert warmup_length(_config("optim.warmup_fraction=0").optim, 7) == 0


def test_the_schedule_peaks_where_the_fraction_says():
    optim = _config("optim.warmup_fraction=0.1").optim
    optimizer = build_optimizer(optim, torch.nn.Linear(4, 4), global_batch=12)
    peak = optimizer.param_groups[0]["lr"]
    schedule = build_schedule(optimizer, warmup_length(optim, 200), 200)
    rates = []
    for _ in range(200):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert rates.index(max(rates)) == 19 and max(rates) == pytest.approx(peak)  # 20 warm-up steps, then cosine
    assert rates[0] == pytest.approx(peak / 20) and rates[-1] < 0.01 * peak


# ---- LAMB and LARS: the rules written out -------------------------------------------------------------


def _problem(seed: int = 0):
    """A weight matrix, a bias and the gradients of two steps, in float64."""
    g = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)
    grads = [(torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64))
             for _ in range(2)]
    return weight, bias, grads


def _run(optimizer_class, weight, bias, grads, **kwargs):
    params = [torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())]
    optimizer = optimizer_class(params, **kwargs)
    for gw, gb in grads:
        params[0].grad, params[1].grad = gw.clone(), gb.clone()
        optimizer.step()
    return params[0].detach(), params[1].detach()


def _lamb_by_hand(w, grads, lr, beta1, beta2, eps, decay, adapt):
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
        update = (m / (1 - beta1 ** t)) / ((v / (1 - beta2 ** t)).sqrt() + eps)
        ratio = 1.0
        if adapt:
            update = update + decay * w
            ratio = float(w.norm() / update.norm())
        w = w - lr * ratio * update
    return w


def _lars_by_hand(w, grads, lr, momentum, decay, eta, eps, adapt):
    buffer = None
    for g in grads:
        d = g
        if adapt:
            d = eta * w.norm() / (g.norm() + decay * w.norm() + eps) * (g + decay * w)
        buffer = d if buffer is None else momentum * buffer + d
        w = w - lr * buffer
    return w


def test_one_and_two_lamb_steps_follow_the_rule_and_leave_biases_unadapted():
    weight, bias, grads = _problem()
    for steps in (1, 2):
        w, b = _run(Lamb, weight, bias, grads[:steps], lr=0.01, weight_decay=0.1)
        assert torch.allclose(w, _lamb_by_hand(weight, [g for g, _ in grads[:steps]], 0.01, 0.9, 0.999, 1e-6, 0.1, True))
        assert torch.allclose(b, _lamb_by_hand(bias, [g for _, g in grads[:steps]], 0.01, 0.9, 0.999, 1e-6, 0.1, False))
    # the trust ratio makes the first step's size lr x ‖w‖ whatever the gradient's scale
    w, _ = _run(Lamb, weight, bias, [(grads[0][0] * 1e4, grads[0][1])], lr=0.01, weight_decay=0.1)
    assert float((w - weight).norm()) == pytest.approx(0.01 * float(weight.norm()))


def test_one_and_two_lars_steps_follow_the_rule_and_leave_biases_unadapted():
    weight, bias, grads = _problem(1)
    for steps in (1, 2):
        w, b = _run(Lars, weight, bias, grads[:steps], lr=0.5, momentum=0.9, weight_decay=0.01)
        assert torch.allclose(w, _lars_by_hand(weight, [g for g, _ in grads[:steps]], 0.5, 0.9, 0.01, 0.001, 1e-8, True))
        assert torch.allclose(b, _lars_by_hand(bias, [g for _, g in grads[:steps]], 0.5, 0.9, 0.01, 0.001, 1e-8, False))


def test_a_zero_weight_takes_the_plain_step_instead_of_none():
    zero, bias, grads = torch.zeros(5, 3, dtype=torch.float64), torch.zeros(5, dtype=torch.float64), _problem()[2]
    w, _ = _run(Lars, zero, bias, grads[:1], lr=0.5, momentum=0.0, weight_decay=0.01)
    assert torch.allclose(w, -0.5 * grads[0][0])  # ratio 1, and the decay of a zero weight is zero
    w, _ = _run(Lamb, zero, bias, grads[:1], lr=0.01, weight_decay=0.1)
    assert torch.count_nonzero(w) == w.numel()


@pytest.mark.parametrize(("factory", "message"), [
    (lambda p: Lamb(p, lr=-1.0), r"lr must be a finite number >= 0.0, got -1.0"),
    (lambda p: Lamb(p, betas=(0.9, 1.0)), r"betas\[1\] must be a finite number in \[0.0, 1.0\), got 1.0"),
    (lambda p: Lars(p, momentum=float("nan")), r"momentum must be a finite number in \[0.0, 1.0\), got nan"),
    (lambda p: Lars(p, trust_coefficient=-0.1), r"trust_coefficient must be a finite number >= 0.0, got -0.1"),
])
def test_bad_arguments_name_the_argument_value_and_rule(factory, message):
    with pytest.raises(ValueError, match=message):
        factory([torch.nn.Parameter(torch.zeros(2, 2))])


# ---- against timm's implementations ----------------------------------------------------------------------


def _timm_optim():
    from tests.reference_models import import_timm

    import_timm()
    import timm.optim

    return timm.optim


def _steps(make, model_seed: int = 0, steps: int = 5):
    """Train a small MLP for ``steps`` steps on fixed data with the optimizer ``make(parameter groups)``."""
    torch.manual_seed(model_seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).double()
    matrices = [p for p in model.parameters() if p.ndim > 1]
    vectors = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = make([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}])
    x, y = torch.randn(16, 6, dtype=torch.float64), torch.randint(0, 3, (16,))
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_lamb_matches_timm_over_five_steps():
    timm_optim = _timm_optim()
    ours = _steps(lambda groups: Lamb(groups, lr=0.02, weight_decay=0.05))
    theirs = _steps(lambda groups: timm_optim.Lamb(groups, lr=0.02, weight_decay=0.05, max_grad_norm=None))
    assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12)


def test_lars_matches_timm_over_five_steps():
    timm_optim = _timm_optim()
    ours = _steps(lambda groups: Lars(groups, lr=2.0, momentum=0.9, weight_decay=0.01))
    theirs = _steps(lambda groups: timm_optim.Lars(groups, lr=2.0, momentum=0.9, weight_decay=0.01))
    assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12)


# ---- in the trainer ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_the_trainer_selects_and_steps_lamb_and_lars_at_the_rules_rate(tmp_path, name):
    config = _config(f"optim.name={name}", "optim.lr=0.01", "optim.warmup_fraction=0.5", "train.max_steps=4",
                     f"workspace={tmp_path / name}")
    assert type(build_optimizer(config.optim, torch.nn.Linear(3, 3), global_batch=12)) is {"lamb": Lamb, "lars": Lars}[name]
    steps_per_epoch = len(build_sampler(config.sampler, build_data(config).train.labels, 1, 0, config.seed))
    result = train(config, Backend())
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    rates = [r["lr"] for r in lines if "loss" in r]
    assert result.global_step == 4 and all(math.isfinite(r["loss"]) for r in lines if "loss" in r)
    peak = 0.01 * (2.0 if name == "lamb" else 4.0)  # 12 images per step against base_batch 3: sqrt or linear
    warmup = warmup_length(config.optim, 2 * steps_per_epoch)  # half of two epochs
    # a step's record holds the rate the schedule set after it, for the next step
    assert warmup > 5 and rates == pytest.approx([peak * (i + 2) / warmup for i in range(4)])
