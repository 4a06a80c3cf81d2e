"""Lightning's ddp on the CPU, two processes: the correct recipes, then the refused misuses, in one launch.

``python lightning_run.py OUT``. Runs, each recorded per rank in OUT/lightning-rank<r>.json:

* ``flat``: flat sampler, plain DataLoader, ``use_distributed_sampler=False``, 2 epochs;
* ``stop``/``resume``: batch sampler in torchdata's StatefulDataLoader (2 workers), a checkpoint at step 20,
  then ``fit(ckpt_path=...)`` for 2 epochs (Lightning saves and restores the loader's state);
* ``batch-default``, ``flat-default``: Lightning's default ``use_distributed_sampler=True``;
* ``early``: a sampler built before ``fit()`` (rank 0 has no launcher environment yet).

Errors are recorded as ``type: message`` (first line); the test reads the records.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from framework_runs import G, K, SEED, IndexDataset, write_record
import lightning as L
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from pksampler.samplers import DistributedBalancedBatchSampler, DistributedBalancedSampler

OUT = Path(sys.argv[1])
EARLY = DistributedBalancedSampler(IndexDataset(), samples_per_class=K, classes_per_step=G, seed=SEED)


class Recorder(L.LightningModule):
    """A one-parameter model whose steps record the sample indices of every batch, by epoch."""

    def __init__(self, make_loader) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.make_loader = make_loader
        self.seen: dict[str, list[list[int]]] = {}

    def train_dataloader(self):
        return self.make_loader()

    def training_step(self, batch, batch_idx):
        indices, _ = batch
        self.seen.setdefault(str(self.current_epoch), []).append(indices.tolist())
        return ((self.weight - 1.0) ** 2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def flat_loader():
    sampler = DistributedBalancedSampler(IndexDataset(), samples_per_class=K, classes_per_step=G, seed=SEED)
    return DataLoader(IndexDataset(), sampler=sampler, batch_size=sampler.batch_size)


def stateful_batch_loader():
    sampler = DistributedBalancedBatchSampler(IndexDataset(), samples_per_class=K, classes_per_step=G, seed=SEED)
    return StatefulDataLoader(IndexDataset(), batch_sampler=sampler, num_workers=2)


def fit(make_loader, *, ckpt_path=None, distributed_sampler=False, **options):
    """One ``Trainer.fit``: the batches seen by epoch, or the error as ``type: first line``."""
    model = Recorder(make_loader)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=distributed_sampler,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, **options)
    try:
        trainer.fit(model, ckpt_path=ckpt_path)
    except Exception as error:  # recorded for the test to check
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    return {"epochs": model.seen, "rank": trainer.global_rank, "world": trainer.world_size}


def main() -> None:
    record: dict[str, dict] = {}
    record["flat"] = fit(flat_loader, max_epochs=2, enable_checkpointing=False)
    checkpoints = OUT / "checkpoints"
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=20, save_top_k=-1)
    record["stop"] = fit(stateful_batch_loader, max_steps=20, callbacks=[saver])
    path = checkpoints / "epoch=0-step=20.ckpt"
    record["resume"] = fit(stateful_batch_loader, ckpt_path=path, max_epochs=2, enable_checkpointing=False)
    batch_form = lambda: DataLoader(IndexDataset(), batch_sampler=DistributedBalancedBatchSampler(  # noqa: E731
        IndexDataset(), samples_per_class=K, classes_per_step=G, seed=SEED))
    record["batch-default"] = fit(batch_form, max_epochs=1, distributed_sampler=True, enable_checkpointing=False)
    record["flat-default"] = fit(flat_loader, max_epochs=1, distributed_sampler=True, enable_checkpointing=False)
    early = lambda: DataLoader(IndexDataset(), sampler=EARLY, batch_size=EARLY.batch_size)  # noqa: E731
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher sets it in every process
    write_record(OUT, f"lightning-rank{rank}", record)  # before "early", whose failure may end this process
    record["early"] = fit(early, max_epochs=1, enable_checkpointing=False)
    write_record(OUT, f"lightning-rank{rank}", record)


if __name__ == "__main__":
    main()
