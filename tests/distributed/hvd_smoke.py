"""Two real Horovod ranks: allreduce, allgather, broadcast, one DistributedOptimizer step.

Each rank checks the result against what it computes locally from every
rank's (deterministic) data, and prints ``SMOKE-OK rank r``.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(8, 5, generator=generator), torch.randn(8, 1, generator=generator)


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert size == 2, size
    mean = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Average)
    assert torch.allclose(mean, torch.tensor([(size - 1) / 2])), mean
    gathered = hvd.allgather(torch.tensor([[rank, rank * 10]]))
    assert gathered.tolist() == [[r, r * 10] for r in range(size)], gathered

    torch.manual_seed(rank)  # different init per rank: the broadcast must fix it
    model = torch.nn.Linear(5, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    x, y = rank_data(rank)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()

    # Reference: the averaged gradient of every rank's loss, computed locally.
    reference = torch.nn.Linear(5, 1)
    reference.load_state_dict(initial)
    grads = [torch.zeros_like(p) for p in reference.parameters()]
    for other in range(size):
        reference.zero_grad()
        xo, yo = rank_data(other)
        torch.nn.functional.mse_loss(reference(xo), yo).backward()
        for g, p in zip(grads, reference.parameters()):
            g += p.grad / size
    with torch.no_grad():
        for p, g in zip(reference.parameters(), grads):
            p -= 0.1 * g
    for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(got, want, atol=1e-6), (name, got, want)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(hvd.allgather(params[None])[0], hvd.allgather(params[None])[1])
    print(f"SMOKE-OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
