"""The loss on a gathered global batch stays exact when ranks hold different numbers of samples.

W = 3 ranks share G = 7 classes (3, 2, 2 classes of K samples each). Every
rank computes the same loss on the all-gathered batch and back-propagates
through its own rows only; the runtime then averages the ranks' parameter
gradients. Simulated here in one process, collective by collective:

* Horovod: the allgather's backward averages the ranks' incoming gradients
  and keeps the rank's rows; the loss is scaled by ``gathered_loss_scale = W``;
  DistributedOptimizer averages over ranks.
* torch: each rank pads to the longest part (:func:`pksampler.comm.pad_rows`),
  the autograd all_gather's backward is a reduce-scatter *sum*, the padding is
  dropped (:func:`pksampler.comm.drop_padding`); scale 1; DDP averages.

Both must give the gradient of one process holding the whole global batch.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from pksampler.comm import drop_padding, pad_rows
from pksampler.samplers import DistributedBalancedBatchSampler
from pksampler.train.losses.pair import build_loss

WORLD, G, K, DIM = 3, 7, 2, 12


def global_step() -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """Inputs and labels of one global step, and each rank's rows of it, from the real sampler."""
    labels = np.arange(700) % 70
    features = torch.from_numpy(np.random.default_rng(0).normal(size=(700, DIM))).float()
    parts = [np.asarray(next(iter(DistributedBalancedBatchSampler(
        labels, samples_per_class=K, classes_per_step=G, num_replicas=WORLD, rank=rank, seed=1))))
        for rank in range(WORLD)]
    assert [p.size for p in parts] == [6, 4, 4]  # ceil(7/3) * K, then floor(7/3) * K
    everything = np.concatenate(parts)
    return features[everything], torch.from_numpy(labels[everything]), parts


class Embed(torch.nn.Module):
    """A small embedding network with unit-length outputs, like the trainer's model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(self.body(x), dim=1)


def model_and_loss() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = Embed()
    return model, build_loss("multi_similarity", {"alpha": 2.0, "beta": 50.0, "base": 0.5, "epsilon": 0.1})


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def single_process_gradient() -> list[torch.Tensor]:
    inputs, labels, _ = global_step()
    model, loss_fn = model_and_loss()
    loss_fn(model(inputs), labels).backward()
    return gradients(model)


def simulated_ranks(runtime: str) -> list[torch.Tensor]:
    """The averaged parameter gradient of W simulated ranks under Horovod's or torch's collectives."""
    inputs, labels, parts = global_step()
    model, loss_fn = model_and_loss()
    sizes = [p.size for p in parts]
    offsets = np.cumsum([0, *sizes])
    replicas = [copy.deepcopy(model) for _ in range(WORLD)]
    local = [replicas[r](inputs[offsets[r]:offsets[r + 1]]) for r in range(WORLD)]
    if runtime == "horovod":
        scale, sent = float(WORLD), [e.detach() for e in local]
        received = torch.cat(sent)  # hvd.allgather: unequal first dims concatenated as they are
    else:
        scale, sent = 1.0, [pad_rows(e.detach(), max(sizes)) for e in local]
        received = torch.cat(sent)  # dist all_gather of the padded parts
    # Forward on every rank: the same loss on the same gathered batch.
    incoming = []
    for rank in range(WORLD):
        gathered = received.clone().requires_grad_(True)
        batch = gathered if runtime == "horovod" else drop_padding(gathered, sizes)
        (loss_fn(batch, labels) * scale).backward()
        incoming.append(gathered.grad)
    # The collective's backward, then each rank's own rows through its replica.
    combined = torch.stack(incoming).mean(0) if runtime == "horovod" else torch.stack(incoming).sum(0)
    for rank in range(WORLD):
        if runtime == "horovod":
            own = combined[offsets[rank]:offsets[rank + 1]]
        else:
            own = combined[rank * max(sizes):rank * max(sizes) + sizes[rank]]
        local[rank].backward(own)
    # DistributedOptimizer and DDP both average the ranks' gradients.
    per_rank = [gradients(replica) for replica in replicas]
    return [torch.stack(grads).mean(0) for grads in zip(*per_rank)]


@pytest.mark.parametrize("runtime", ["horovod", "torch"])
def test_summed_rank_gradients_equal_the_single_process_gradient_with_unequal_parts(runtime):
    expected = single_process_gradient()
    assert any(float(g.abs().max()) > 1e-3 for g in expected)  # a real gradient, not zeros
    for got, want in zip(simulated_ranks(runtime), expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_padding_round_trip_keeps_rank_order_and_gradients_reach_only_real_rows():
    sizes = [3, 1, 2]
    parts = [torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) + 10 * r for r, n in enumerate(sizes)]
    leaves = [p.clone().requires_grad_(True) for p in parts]
    gathered = drop_padding(torch.cat([pad_rows(p, 3) for p in leaves]), sizes)
    torch.testing.assert_close(gathered, torch.cat(parts))
    gathered.sum().backward()
    assert all(torch.equal(leaf.grad, torch.ones_like(leaf)) for leaf in leaves)
    assert drop_padding(torch.ones(6, 2), [2, 2, 2]).shape == (6, 2)
