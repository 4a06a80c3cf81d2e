"""The metric-learning training loop, written once for every backend.

Order of a run (the Horovod recipe; lines that exist only for distribution
go through :class:`~pksampler.train.distributed.Backend`):

1. init the backend, pin threads/device, seed;
2. data: class-disjoint split, train subset with keyed augmentation, test subset;
3. the sampler with the backend's rank/size, checked for consistency across ranks;
4. model, optimizer (lr scaled with the global batch), warm-up + cosine schedule;
5. resume: rank 0 reads the last checkpoint, everyone receives it by broadcast;
6. broadcast parameters and optimizer state from rank 0; wrap for allreduce;
7. per epoch: ``set_epoch`` on sampler and data, train (embeddings all-gathered
   so the loss sees the global batch), evaluate every N epochs;
8. rank 0 alone logs, shows progress, writes metrics, PNGs and checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from pksampler.datasets import (
    ImageFolderDataset,
    LabelledSubset,
    ListFileDataset,
    SyntheticProducts,
    class_disjoint_split,
    eval_preset,
    train_preset,
)
from pksampler.datasets.base import LabelledDataset
from pksampler.samplers import DistributedBalancedBatchSampler, check_consistent

from .checkpoint import load_checkpoint, save_checkpoint
from .config import ConfigError, RunConfig
from .distributed import Backend, make_backend
from .evaluate import knn_search, retrieval_metrics, save_gallery_png
from .losses import build_loss
from .model import build_model
from .plots import save_curves_png

__all__ = ["TrainResult", "main", "train"]

#: test hook: "rank:step" makes that rank exit with status 3 at that global step
CRASH_ENV = "PKSAMPLER_TEST_CRASH"


@dataclass
class TrainResult:
    global_step: int
    epochs_done: int
    final_metrics: dict[str, float]
    workspace: Path


def build_data(config: RunConfig) -> tuple[LabelledDataset, LabelledSubset, LabelledSubset]:
    """The full dataset and its class-disjoint train and test subsets."""
    data = config.data
    args = dict(data.args)
    root = Path(data.root) if data.root else None
    try:
        if data.name == "synthetic":
            dataset: LabelledDataset = SyntheticProducts(**args, root=root, augment_seed=config.seed)
        elif data.name == "folder":
            if root is None:
                raise ConfigError("data.root: required for data.name='folder' (or set DATASETS_PATH/DATASETS)")
            dataset = ImageFolderDataset(root, seed=config.seed, **args)
        else:
            if "list_file" not in args:
                raise ConfigError("data.args.list_file: required for data.name='list'")
            list_file = Path(args.pop("list_file"))
            if root is not None and not list_file.is_absolute():
                list_file = root / list_file
            dataset = ListFileDataset(list_file, root=root, seed=config.seed, **args)
    except TypeError as error:
        raise ConfigError(f"data.args: {error}") from None
    train_idx, test_idx = class_disjoint_split(dataset.labels, data.test_fraction, data.split_seed)
    train_set = LabelledSubset(dataset, train_idx, transform=train_preset(data.image_size))
    test_set = LabelledSubset(dataset, test_idx, transform=eval_preset(data.image_size))
    return dataset, train_set, test_set


def refresh_hard_negatives(sampler, model: torch.nn.Module, train_set: LabelledSubset, backend: Backend,
                           image_size: int) -> None:
    """Embed the training set (no augmentation) and update the sampler's class-neighbour table."""
    plain = LabelledSubset(train_set.dataset, train_set.indices, transform=eval_preset(image_size))
    embeddings = embed(model, plain, backend)
    sampler.update_class_neighbours(embeddings, plain.labels, broadcast=backend.broadcast_object)


def build_sampler(config: RunConfig, labels: np.ndarray, backend: Backend):
    args = dict(config.sampler.args)
    common = {"num_replicas": backend.size, "rank": backend.rank, "seed": config.seed}
    try:
        if config.sampler.name == "triplet":
            from pksampler.samplers import DistributedTripletBatchSampler

            return DistributedTripletBatchSampler(labels, **args, **common)
        return DistributedBalancedBatchSampler(labels, **args, **common)
    except TypeError as error:
        raise ConfigError(f"sampler.args: {error}") from None


def _schedule(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def _optimizer(config: RunConfig, model: torch.nn.Module, global_batch: int) -> tuple[torch.optim.Optimizer, float]:
    lr = config.optim.lr * global_batch / config.optim.base_batch
    if config.optim.name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=config.optim.momentum,
                              weight_decay=config.optim.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.optim.weight_decay)
    return opt, lr


class _Log:
    """Rank-0 metrics.jsonl writer (appends, flushes every line)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.handle = open(path, "a", encoding="utf-8") if enabled else None

    def write(self, **record: Any) -> None:
        if self.handle is not None:
            self.handle.write(json.dumps(record) + "\n")
            self.handle.flush()

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def embed(model: torch.nn.Module, dataset: LabelledSubset, backend: Backend, batch_size: int = 128,
          workers: int = 0) -> np.ndarray:
    """Embeddings of every item of ``dataset``: each rank embeds a strided share, then all-gather."""
    count = len(dataset)
    per_rank = -(-count // backend.size)
    mine = np.arange(backend.rank, count, backend.size)
    mine = np.concatenate([mine, np.full(per_rank - mine.size, mine[-1] if mine.size else 0)]).astype(np.int64)
    loader = DataLoader(torch.utils.data.Subset(dataset, mine.tolist()), batch_size=batch_size, num_workers=workers)
    parts = []
    model.eval()
    with torch.no_grad():
        for images, _ in loader:
            parts.append(model(images))
    local = torch.cat(parts) if parts else torch.zeros(0, 1)
    gathered = backend.allgather(local).numpy()  # (W * per_rank, D): rank-major
    order = np.arange(backend.size)[:, None] + backend.size * np.arange(per_rank)[None, :]
    result = np.empty((count, gathered.shape[1]), dtype=np.float32)
    valid = order < count
    result[order[valid]] = gathered.reshape(backend.size, per_rank, -1)[valid]
    return result


def gather_batch(backend: Backend, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather embeddings (keeping gradients) and labels in one collective.

    Labels travel as an extra float64 column (exact below 2**53), so a step
    pays for one negotiation instead of two.
    """
    packed = torch.cat([embeddings.double(), labels.double()[:, None]], dim=1)
    gathered = backend.allgather(packed)
    return gathered[:, :-1].to(embeddings.dtype), gathered[:, -1].round().long()


def train(config: RunConfig, backend: Backend) -> TrainResult:
    """Run training as ``config`` says on ``backend``; returns what was reached."""
    is_main = backend.rank == 0
    torch.set_num_threads(config.train.threads)
    torch.manual_seed(config.seed)
    workspace = Path(config.workspace)
    if is_main:
        (workspace / "checkpoints").mkdir(parents=True, exist_ok=True)
        (workspace / "galleries").mkdir(parents=True, exist_ok=True)
        (workspace / "config.json").write_text(json.dumps(config.to_dict(), indent=2))

    dataset, train_set, test_set = build_data(config)
    sampler = build_sampler(config, train_set.labels, backend)
    check_consistent(sampler, allgather=backend.allgather_numpy)
    global_batch = sampler.batch_size * backend.size

    norm_class = backend.sync_batch_norm() if config.model.norm == "sync_batch" else None
    model = build_model(config.model, norm_class)
    optimizer, lr = _optimizer(config, model, global_batch)
    # Wrap before loading any state: Horovod's DistributedOptimizer is a new
    # optimizer built from the param groups and does not carry state over.
    train_model, optimizer = backend.wrap(model, optimizer, fp16_allreduce=config.train.fp16_allreduce,
                                          backward_passes_per_step=config.train.backward_passes_per_step)
    total_steps = config.train.epochs * -(-sampler.num_batches // config.train.backward_passes_per_step)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config.optim.warmup_steps, total_steps))
    loss_fn = build_loss(config.loss.name, config.loss.args)

    # --- resume: rank 0 reads, every rank receives the same state -------------------
    last_path = workspace / "checkpoints" / "last.pt"
    state = None
    if config.train.resume and is_main and last_path.is_file():
        state = load_checkpoint(last_path)
    state = backend.broadcast_object(state) if backend.size > 1 else state
    start_epoch, global_step, best = 0, 0, -1.0
    history: dict[str, list] = {"loss_steps": [], "losses": [], "eval_epochs": [], "recalls": []}
    sampler_state = None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, global_step, best = state["epoch"], state["global_step"], state["best"]
        history, sampler_state = state["history"], state["sampler"]
    backend.broadcast_state(model, optimizer)

    log = _Log(workspace / "metrics.jsonl", is_main)
    if is_main:
        print(f"[pksampler] backend={backend.name} world={backend.size} train={len(train_set)} images "
              f"({np.unique(train_set.labels).size} classes) test={len(test_set)} images "
              f"({np.unique(test_set.labels).size} classes) batch/rank={sampler.batch_size} global={global_batch} "
              f"lr={lr:.4g} steps/epoch={sampler.num_batches}"
              + (f" resumed at epoch {start_epoch} step {global_step}" if state is not None else ""), flush=True)

    crash = os.environ.get(CRASH_ENV)
    crash_rank, crash_step = (int(v) for v in crash.split(":")) if crash else (-1, -1)
    passes = config.train.backward_passes_per_step
    # Gathered embeddings give every rank the global batch and loss; otherwise
    # the logged loss is averaged across ranks.
    gather = config.train.gather_embeddings and backend.size > 1
    reduce_loss = backend.size > 1 and not gather
    final_metrics: dict[str, float] = {}

    def checkpoint(epoch: int, consumed: int, end_of_epoch: bool, name: str = "last.pt") -> None:
        if not is_main:
            return
        position = sampler.state_dict(batches_consumed=consumed)
        if end_of_epoch:
            position.update(epoch=epoch + 1, step=0)
        save_checkpoint(workspace / "checkpoints" / name, {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch + 1 if end_of_epoch else epoch,
            "global_step": global_step,
            "best": best,
            "sampler": position,
            "history": history,
            "world_size": backend.size,
            "config": config.to_dict(),
        })

    if is_main and start_epoch >= config.train.epochs:
        print(f"[pksampler] {workspace} holds a finished run ({start_epoch} epochs); "
              "pass --no-resume (or another WORKSPACE) to train again", flush=True)
    if config.train.max_steps is not None and global_step >= config.train.max_steps:
        checkpoint(start_epoch, 0, end_of_epoch=False)  # e.g. max_steps=0: the initial parameters
        log.close()
        return TrainResult(global_step, start_epoch, final_metrics, workspace)
    try:
        for epoch in range(start_epoch, config.train.epochs):
            sampler.set_epoch(epoch)
            train_set.set_epoch(epoch)
            if sampler_state is not None and sampler_state["epoch"] == epoch:
                sampler.load_state_dict(sampler_state)
            sampler_state = None
            loader = DataLoader(train_set, batch_sampler=sampler, num_workers=config.data.workers,
                                persistent_workers=False)
            consumed, started, batches = 0, time.perf_counter(), len(sampler)
            progress = _progress(is_main, batches, epoch, config.train.epochs)
            for images, labels in loader:
                train_model.train()
                last_of_window = (consumed + 1) % passes == 0 or consumed + 1 == batches
                context = contextlib.nullcontext() if last_of_window else backend.accumulating(train_model)
                with context:
                    embeddings = train_model(images)
                    if gather:
                        all_embeddings, all_labels = gather_batch(backend, embeddings, labels)
                        scale = backend.gathered_loss_scale
                    else:
                        all_embeddings, all_labels, scale = embeddings, labels, 1.0
                    loss = loss_fn(all_embeddings, all_labels)
                    (loss * (scale / passes)).backward()
                consumed += 1
                if not last_of_window:
                    continue
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                global_step += 1
                mean_loss = float(backend.allreduce_mean(loss.detach().reshape(1))[0] if reduce_loss else loss.detach())
                rate = consumed * global_batch / max(time.perf_counter() - started, 1e-9)
                history["loss_steps"].append(global_step)
                history["losses"].append(mean_loss)
                log.write(type="step", epoch=epoch, step=consumed, global_step=global_step, loss=mean_loss,
                          lr=scheduler.get_last_lr()[0], images_per_sec=rate, global_batch=global_batch,
                          time=time.time())
                if progress is not None:
                    progress.set_postfix(loss=f"{mean_loss:.4f}", img_s=f"{rate:.0f}")
                    progress.update(consumed - progress.n)
                if backend.rank == crash_rank and global_step == crash_step:
                    print(f"[pksampler] rank {backend.rank}: simulated crash at step {global_step}", flush=True)
                    os._exit(3)
                at_limit = config.train.max_steps is not None and global_step >= config.train.max_steps
                if at_limit or (config.train.checkpoint_every and global_step % config.train.checkpoint_every == 0):
                    checkpoint(epoch, consumed, end_of_epoch=consumed == batches)
                if at_limit:
                    if progress is not None:
                        progress.close()
                    return TrainResult(global_step, epoch, final_metrics, workspace)
            if progress is not None:
                progress.close()
            last_epoch = epoch + 1 == config.train.epochs
            if (epoch + 1) % config.train.eval_every == 0 or last_epoch:
                final_metrics = evaluate(config, model, dataset, test_set, backend, epoch, log)
                if is_main:
                    history["eval_epochs"].append(epoch + 1)
                    history["recalls"].append(final_metrics["recall_at_1"])
                    if final_metrics["recall_at_1"] > best:
                        best = final_metrics["recall_at_1"]
                        checkpoint(epoch, consumed, end_of_epoch=True, name="best.pt")
            if getattr(sampler, "negatives", None) == "hard" and not last_epoch:
                refresh_hard_negatives(sampler, model, train_set, backend, config.data.image_size)
            checkpoint(epoch, consumed, end_of_epoch=True)
        if is_main:
            save_curves_png(workspace / "curves.png", history["loss_steps"], history["losses"],
                            history["eval_epochs"], history["recalls"])
            (workspace / "final_metrics.json").write_text(json.dumps(final_metrics, indent=2))
    finally:
        log.close()
    return TrainResult(global_step, config.train.epochs, final_metrics, workspace)


def _progress(enabled: bool, total: int, epoch: int, epochs: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"epoch {epoch + 1}/{epochs}", unit="batch", dynamic_ncols=True,
                file=sys.stderr, mininterval=1.0)


def evaluate(config: RunConfig, model: torch.nn.Module, dataset: LabelledDataset, test_set: LabelledSubset,
             backend: Backend, epoch: int, log: _Log) -> dict[str, float]:
    """Held-out-class retrieval metrics (rank 0 computes; every rank embeds a share)."""
    embeddings = embed(model, test_set, backend, workers=0)
    if backend.rank != 0:
        return {}
    metrics = retrieval_metrics(embeddings, test_set.labels, ks=(1, 5, 10))
    log.write(type="eval", epoch=epoch + 1, **metrics)
    print(f"[pksampler] epoch {epoch + 1}: " + " ".join(
        f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)), flush=True)
    queries = np.linspace(0, len(test_set) - 1, num=min(config.train.gallery_queries, len(test_set))).astype(int)
    _, nearest = knn_search(embeddings[queries], embeddings, 6)
    neighbours = np.array([[n for n in row if n != q][:5] for q, row in zip(queries, nearest)])  # not the query itself
    parent = test_set.indices
    correct = test_set.labels[neighbours] == test_set.labels[queries][:, None]
    save_gallery_png(
        Path(config.workspace) / "galleries" / f"epoch_{epoch + 1:03d}.png",
        [dataset.load(int(parent[q])) for q in queries],
        [[dataset.load(int(parent[n])) for n in row] for row in neighbours],
        correct,
    )
    return metrics


def main(config: RunConfig) -> TrainResult:
    """Initialise the backend chosen by ``config.distributed.backend`` and train."""
    backend = make_backend(config.distributed.backend)
    result = train(config, backend)
    # Leave together: a rank that exits while another still uses the group
    # (rank 0 writing the last checkpoint) would abort it.
    backend.barrier()
    backend.shutdown()
    return result
