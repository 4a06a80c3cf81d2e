"""torchdata's StatefulDataLoader and pytorch-ignite's auto_dataloader under torchrun, two processes.

``torchrun --nproc_per_node 2 stateful_run.py OUT``. For each form (batch, flat) and 0 or 2 workers:
read 20 batches of epoch 1, save the loader's state, load it into a new loader over a new sampler,
read the rest of the epoch, then all of epoch 2. Then ``check_consistent`` with the live process
group, once right and once with a sampler that claims rank 0 on both processes. Last, ignite's
``idist.auto_dataloader`` on the same process group: the batch form as ``batch_sampler=`` (epochs 0
and 1), and the flat form as ``sampler=``, which ignite wraps in its re-sharding
``DistributedProxySampler`` (the error is recorded).
Recorded per rank in OUT/stateful-rank<r>.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

from framework_runs import G, K, SEED, IndexDataset, write_record
import torch.distributed as dist
from torchdata.stateful_dataloader import StatefulDataLoader

from pksampler.samplers import DistributedBalancedBatchSampler, DistributedBalancedSampler, check_consistent

STOP = 20


def loader(form: str, workers: int) -> StatefulDataLoader:
    options = dict(samples_per_class=K, classes_per_step=G, seed=SEED)
    if form == "batch":
        return StatefulDataLoader(IndexDataset(), batch_sampler=DistributedBalancedBatchSampler(IndexDataset(), **options),
                                  num_workers=workers)
    sampler = DistributedBalancedSampler(IndexDataset(), **options)
    return StatefulDataLoader(IndexDataset(), sampler=sampler, batch_size=sampler.batch_size, num_workers=workers)


def set_epoch(loader_: StatefulDataLoader, epoch: int) -> None:
    owner = loader_.batch_sampler if isinstance(loader_.batch_sampler, DistributedBalancedBatchSampler) else loader_.sampler
    owner.set_epoch(epoch)


def resumed_run(form: str, workers: int) -> dict:
    """Batches before the save, after the resume (same epoch) and of the next epoch; ``len`` of the loaders."""
    first = loader(form, workers)
    set_epoch(first, 1)
    iterator = iter(first)
    before = [next(iterator)[0].tolist() for _ in range(STOP)]
    state = first.state_dict()
    second = loader(form, workers)
    second.load_state_dict(state)
    after = [indices.tolist() for indices, _ in second]
    set_epoch(second, 2)
    following = [indices.tolist() for indices, _ in second]
    return {"before": before, "after": after, "next": following, "len": [len(first), len(second)]}


def ignite_runs() -> dict:
    """``idist.auto_dataloader`` with the batch form (kept as it is) and the flat form (wrapped: refused)."""
    import ignite.distributed as idist

    options = dict(samples_per_class=K, classes_per_step=G, seed=SEED)
    batches = DistributedBalancedBatchSampler(IndexDataset(), **options)
    kept = idist.auto_dataloader(IndexDataset(), batch_sampler=batches)
    epochs = {}
    for epoch in (0, 1):
        batches.set_epoch(epoch)
        epochs[str(epoch)] = [indices.tolist() for indices, _ in kept]
    flat = DistributedBalancedSampler(IndexDataset(), **options)
    wrapped = idist.auto_dataloader(IndexDataset(), sampler=flat, batch_size=flat.batch_size)
    try:
        next(iter(wrapped))
        error = f"no error: {type(wrapped.sampler).__name__}"
    except Exception as caught:  # recorded for the test to check
        error = f"{type(caught).__name__}: {caught}"
    return {"batch": {"epochs": epochs}, "flat": error}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record = {f"{form}-{workers}": resumed_run(form, workers) for form in ("batch", "flat") for workers in (0, 2)}
    right = DistributedBalancedBatchSampler(IndexDataset(), samples_per_class=K, classes_per_step=G, seed=SEED)
    check_consistent(right)
    wrong = DistributedBalancedBatchSampler(IndexDataset(), samples_per_class=K, classes_per_step=G, seed=SEED,
                                            num_replicas=2, rank=0)
    try:
        check_consistent(wrong)
        record["wrong-rank"] = "no error"
    except Exception as error:  # recorded for the test to check
        record["wrong-rank"] = f"{type(error).__name__}: {error}"
    record["ignite"] = ignite_runs()
    write_record(Path(sys.argv[1]), f"stateful-rank{rank}", record)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
