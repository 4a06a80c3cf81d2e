"""Accelerate on the CPU, two processes (``ACCELERATE_USE_CPU=true accelerate launch --multi_gpu
--num_processes 2 accelerate_run.py OUT``): the recipe, then each way of preparing the loader.

* ``recipe``: model and optimizer prepared, the DataLoader left out of ``prepare``, ``set_epoch`` by hand,
  2 epochs, batch form; recorded per rank;
* ``prepare-batch``, ``prepare-flat``: ``accelerator.prepare(loader)`` (``BatchSamplerShard``);
* ``split``, ``dispatch``: ``prepare_data_loader(..., split_batches=True)`` / ``dispatch_batches=True``.

Each misuse records its error as ``type: first line``; OUT/accelerate-rank<r>.json holds the record.
"""

from __future__ import annotations

import sys
from pathlib import Path

from framework_runs import G, K, SEED, IndexDataset, write_record
import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader

from pksampler.samplers import DistributedBalancedBatchSampler, DistributedBalancedSampler


def batch_loader() -> DataLoader:
    sampler = DistributedBalancedBatchSampler(IndexDataset(), samples_per_class=K, classes_per_step=G, seed=SEED)
    return DataLoader(IndexDataset(), batch_sampler=sampler)


def flat_loader() -> DataLoader:
    sampler = DistributedBalancedSampler(IndexDataset(), samples_per_class=K, classes_per_step=G, seed=SEED)
    return DataLoader(IndexDataset(), sampler=sampler, batch_size=sampler.batch_size)


def first_batch(make) -> dict:
    """The first batch of a prepared loader, or its error as ``type: first line``."""
    try:
        return {"batch": next(iter(make()))[0].tolist()}
    except Exception as error:  # recorded for the test to check
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator()
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = batch_loader()
    epochs: dict[str, list[list[int]]] = {}
    for epoch in range(2):
        loader.batch_sampler.set_epoch(epoch)
        for indices, _ in loader:
            epochs.setdefault(str(epoch), []).append(indices.tolist())
            loss = model(indices.float()[:, None] / 2000).square().mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    rank, world = accelerator.process_index, accelerator.num_processes
    record = {"recipe": {"epochs": epochs, "rank": rank, "world": world}}
    record["prepare-batch"] = first_batch(lambda: accelerator.prepare(batch_loader()))
    record["prepare-flat"] = first_batch(lambda: accelerator.prepare(flat_loader()))
    record["split"] = first_batch(lambda: prepare_data_loader(flat_loader(), num_processes=world, process_index=rank,
                                                              split_batches=True))
    record["dispatch"] = first_batch(lambda: prepare_data_loader(flat_loader(), accelerator.device, num_processes=world,
                                                                 process_index=rank, dispatch_batches=True,
                                                                 put_on_device=True))
    write_record(out, f"accelerate-rank{rank}", record)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
