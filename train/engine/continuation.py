"""Continue a previous run's model on today's label set (``train.init_from``): kept by name, new rows imprinted.

A catalogue grows between runs, so a new run starts from last week's weights
on this week's classes (not a resume: the schedule, the optimizer and the loop
start afresh). Classes are matched by *name* (folder name, list-file label,
shard label name, ``<dataset>/<class>`` when several sets are joined), never by
code, since codes follow the sorted names and shift as classes come and go:

* the model (backbone, projection, neck) and the head's BNNeck are loaded as
  they are; the pair loss's state is not (a cross-batch memory holds old codes);
* a kept class's head row is the saved row of its name;
* a new training class's row is imprinted (Qi et al. 2018, "Low-Shot Learning
  with Imprinted Weights"): the normalised mean of its training images'
  normalised embeddings, the model in eval mode (the embedding retrieval
  reads), scaled to the mean length of the kept rows the saved run trained, so it learns at their rate
  (an SGD step turns a row by about lr/‖w‖²). Each rank embeds the images of
  the new classes in its own row range and sums them in float64 in blocks: no
  rank holds more than one block of embeddings, and the rows are the same at
  every world size (up to float summation order). With a BNNeck the images go
  through the neck under the statistics of a fixed sample of the training
  images (:func:`neck_statistics`), not a block's own: a block may hold one
  class, or one image, and differs with the world size. ``train.init_rows: random``
  leaves the new rows at the head's initial draw instead (a comparison arm);
  a new class without training images (a held-out class) keeps that draw too;
* classes the saved run had and today's set lacks are dropped.

The rows' momentum and the dense optimizer's state are reset, not carried:
the new run restarts its schedule at the warm-up, and momentum built on the
old class set's loss would push the kept rows along last week's gradient
while the new rows start from rest.

Every rank maps the checkpoint file (``torch.load(mmap=True)``) and reads only
its own rows: the file must be readable on every host (a shared file system,
or a copy per host).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from pksampler.datasets import LabelledSubset
from pksampler.train.engine.checkpoint import (CheckpointError, check_training_checkpoint, count_non_finite,
                                              load_checkpoint)
from pksampler.train.errors import ConfigError
from pksampler.train.evaluation.heldout import embed_rows
from pksampler.train.losses.headed import HeadedLoss, saved_row_shape, saved_rows
from pksampler.train.modeling.range_checkpoint import RangeFileError, located
from pksampler.train.modeling.sharded_head import INIT_STD, ShardedMarginHead

__all__ = ["ClassMatch", "Continuation", "class_record", "continue_from", "imprint_rows", "match_classes",
           "neck_statistics", "recorded_known"]

#: the resume's advice that ends a checkpoint's refusal (:mod:`.checkpoint`), cut from train.init_from's
_RESUME_ADVICE = re.compile(r"[.:;]? *(Delete it or )?start afresh with --no-resume or another WORKSPACE$")

#: training images embedded per block while imprinting (bounds a rank's memory at BLOCK × D floats)
IMPRINT_BLOCK = 1024


def class_record(names: Sequence[str], train_labels: np.ndarray, known: np.ndarray | None = None) -> dict[str, Any]:
    """What a checkpoint records of its classes: every name by code, and the codes it trained on; for a continued
    run, ``known`` too (per code: whether the run it continued from trained on it), so that a resume of it keeps
    reporting the image-level metrics of known and new classes apart without reading that run again."""
    record: dict[str, Any] = {"names": [str(name) for name in names],
                              "trained": torch.from_numpy(np.unique(np.asarray(train_labels)).astype(np.int64))}
    if known is not None:
        record["known"] = torch.from_numpy(np.asarray(known, dtype=bool).copy())
    return record


def recorded_known(state: dict[str, Any] | None, classes: int) -> np.ndarray | None:
    """The ``known`` mask a resumed checkpoint's class record holds (:func:`class_record`); None when it holds none
    or one that does not fit ``classes`` codes."""
    record = state.get("classes") if isinstance(state, dict) else None
    known = record.get("known") if isinstance(record, dict) else None
    if not isinstance(known, torch.Tensor) or known.dtype != torch.bool or tuple(known.shape) != (classes,):
        return None
    return known.numpy().copy()


@dataclass(frozen=True)
class ClassMatch:
    """Today's classes against a saved run's, by name."""

    #: per class code today: its code in the saved run, -1 for a class the saved run did not have
    saved_of: np.ndarray
    #: saved classes that today's set lacks
    dropped: int

    @property
    def kept(self) -> int:
        return int(np.count_nonzero(self.saved_of >= 0))

    @property
    def added(self) -> int:
        return int(np.count_nonzero(self.saved_of < 0))


def match_classes(saved_names: Sequence[str], names: Sequence[str]) -> ClassMatch:
    """Match ``names`` (today's, by code) to ``saved_names`` by string; vectorised (a sort and a search)."""
    saved = np.asarray([str(n) for n in saved_names], dtype=object).astype(str)
    today = np.asarray([str(n) for n in names], dtype=object).astype(str)
    if not saved.size:
        return ClassMatch(np.full(today.size, -1, dtype=np.int64), 0)
    order = np.argsort(saved, kind="stable")
    position = np.minimum(np.searchsorted(saved[order], today), saved.size - 1)
    found = saved[order][position] == today
    saved_of = np.where(found, order[position], -1).astype(np.int64)
    return ClassMatch(saved_of, int(saved.size - np.unique(saved_of[found]).size))


@dataclass(frozen=True)
class Continuation:
    """What :func:`continue_from` did, for the start-up line and the known/new evaluation."""

    path: str
    match: ClassMatch | None  # None: the run has no head (only the model was taken)
    imprinted: int  # rows imprinted (all ranks)
    images: int  # training images embedded for them (all ranks)
    rows: str  # train.init_rows
    #: per class code today: whether the saved run trained on it (the image-level evaluation's "known")
    known: np.ndarray
    #: training classes of the saved run that are held-out classes today
    now_held_out: int
    #: whether the saved run had a head (without one, every row of this run's head is new)
    saved_head: bool = True

    def line(self) -> str:
        """The one start-up line: kept, added, dropped, how the new rows began, what was reset and why."""
        if self.match is None:
            classes = "no head in this run: the model alone"
        else:
            how = (f"{self.imprinted:,} imprinted from {self.images:,} images" if self.rows == "imprint"
                   else "random rows")
            classes = (f"classes kept {self.match.kept:,}, added {self.match.added:,} ({how}), "
                       f"dropped {self.match.dropped:,}")
            if not self.saved_head:
                classes = (f"the saved run had no head, every row is new ({how}); classes it knew by name "
                           f"{self.match.kept:,}, added {self.match.added:,}, dropped {self.match.dropped:,}")
        if self.match is not None and not self.match.kept and self.match.dropped:
            classes += ("; no class name matched the saved run's (joining datasets names each class "
                        "<dataset>/<class>, so a set that joins others or leaves them renames every class)")
        leak = (f"; {self.now_held_out:,} classes it trained on are held out now (their class-disjoint metrics "
                "overstate: data.split_by: name keeps each class on its side)" if self.now_held_out else "")
        return (f"[pksampler] init_from {self.path}: {classes}; optimizer state and row momentum reset (a new run "
                f"restarts its schedule at the warm-up){leak}")


def _read(path: str) -> dict[str, Any]:
    """The checkpoint, mapped; refused in one line naming ``train.init_from`` when it cannot be continued."""
    try:
        state = located(load_checkpoint(path, mmap=True), Path(path))  # the head's range files, if it has them
        check_training_checkpoint(state, path)
    except CheckpointError as error:  # its advice is a resume's: the continued run's workspace is not at fault
        reason = _RESUME_ADVICE.sub("", str(error))
        raise ConfigError(f"train.init_from: {reason}; continue from another checkpoint") from None
    record = state.get("classes")
    if not isinstance(record, dict) or not isinstance(record.get("names"), list):
        raise ConfigError(f"train.init_from: {path} records no class names (written before checkpoints kept them); "
                          "classes are matched by name, never by code: continue from a newer checkpoint")
    _check_record(record, state["loss"] if "head" in state["loss"] else None, path)
    bad = count_non_finite(state["model"])
    if bad:
        raise ConfigError(f"train.init_from: {path} holds {bad} NaN or infinite model value(s) (a run that "
                          "diverged): continue from an earlier checkpoint of it")
    return state


def _check_record(record: dict[str, Any], saved_loss: Any, path: str) -> None:
    """Refuse a class record that cannot be matched by name: names that are not distinct strings, trained codes
    outside them, or a head (``saved_loss``: the loss state holding it) whose rows are not one (subcentres,
    dimension) float block per name."""
    head = None if saved_loss is None or "ranges" in saved_loss else saved_loss["head"]
    names, trained = record["names"], record.get("trained", torch.zeros(0, dtype=torch.int64))
    problem = None
    if not all(isinstance(name, str) for name in names) or len(set(names)) != len(names):
        problem = "its class names are not distinct strings"
    elif not isinstance(trained, torch.Tensor) or trained.dtype != torch.int64 or trained.dim() != 1 or (
            trained.numel() and not (0 <= int(trained.min()) and int(trained.max()) < len(names))):
        problem = f"its trained classes are not codes of its {len(names):,} names"
    elif saved_loss is not None and "ranges" in saved_loss and saved_row_shape(saved_loss)[0] != len(names):
        problem = f"its head's rows are not one block for each of its {len(names):,} names"
    elif head is not None and not (isinstance(head, dict) and isinstance(head.get("rows"), torch.Tensor)
                                   and head["rows"].is_floating_point() and head["rows"].dim() == 3
                                   and head["rows"].shape[0] == len(names)):
        problem = f"its head's rows are not one (subcentres, dimension) block for each of its {len(names):,} names"
    if problem is not None:
        raise ConfigError(f"train.init_from: {path}: {problem}; the file is damaged or not a pksampler training "
                          "checkpoint")


def _load_model(model: torch.nn.Module, saved: Any, path: str, part: str = "model.* keys") -> None:
    """``saved`` into ``model``, or one line naming the part (``part``) that does not fit."""
    try:
        model.load_state_dict(saved)
    except (RuntimeError, TypeError, AttributeError) as error:
        reason = " ".join(str(error).split())[:240]
        raise ConfigError(f"train.init_from: {path}: its model does not fit this run's {part} ({reason}); "
                          "continue with the architecture it was trained with") from None


def _load_kept_rows(head: ShardedMarginHead, saved_loss: dict[str, Any] | None, saved_of: np.ndarray,
                    path: str) -> torch.Tensor:
    """Copy this rank's kept rows from the saved head (``saved_loss``: the loss state holding it; only the
    range files that hold them are read); the local indices of the new rows."""
    local = saved_of[head.lo:head.hi]
    kept = np.flatnonzero(local >= 0)
    if saved_loss is not None and kept.size:
        shape = saved_row_shape(saved_loss)
        if tuple(shape[1:]) != (head.subcentres, head.dim):
            raise ConfigError(f"train.init_from: {path}: its head rows are {tuple(shape[1:])} (subcentres, "
                              f"dimension), this run's ({head.subcentres}, {head.dim}): head.subcentres and "
                              "model.embedding_dim must match")
        try:
            taken = saved_rows(saved_loss, local[kept])
        except RangeFileError as error:
            raise ConfigError(f"train.init_from: {error}") from None
        if not torch.isfinite(taken).all():
            raise ConfigError(f"train.init_from: {path}: its head holds NaN or infinite rows (a run that "
                              "diverged): continue from an earlier checkpoint of it")
        head.set_rows(torch.from_numpy(kept), taken)
    elif saved_loss is None:
        kept = np.zeros(0, dtype=np.int64)
    return torch.from_numpy(np.setdiff1d(np.arange(local.size), kept))


def _mean_length(head: ShardedMarginHead, known: np.ndarray, backend: Any) -> float:
    """The mean length of the kept rows the saved run trained (``known``: per class code) over every rank, in
    float64; the initial rows' when there is none (a held-out class's row never was a positive: not counted)."""
    mine = torch.from_numpy(np.flatnonzero(known[head.lo:head.hi])).to(head.rows.device)
    norms = head.rows[mine].double().norm(dim=2).flatten()
    total = torch.stack([norms.sum(), torch.tensor(float(norms.numel()), dtype=torch.float64)])
    if backend.size > 1:
        total = backend.allreduce_sum(total.to(head.rows.device)).cpu()
    return float(total[0] / total[1]) if total[1] > 0 else INIT_STD * head.dim ** 0.5


def imprint_rows(head: ShardedMarginHead, embed: Callable[[np.ndarray], torch.Tensor], labels: np.ndarray,
                 new_local: torch.Tensor, *, length: float) -> tuple[int, int]:
    """Imprint this rank's new rows ``new_local`` (local indices) from the training items of their classes.

    ``labels``: the training items' class codes; ``embed(positions)``: the embeddings of those training items
    (eval mode), at most :data:`IMPRINT_BLOCK` at once. A row becomes ``length`` × the normalised mean of its
    items' normalised embeddings, every subcentre alike. Returns (rows imprinted, images embedded) on this rank.
    """
    labels = np.asarray(labels)
    new_classes = head.lo + new_local.numpy()
    items = np.flatnonzero(np.isin(labels, new_classes))
    sums = torch.zeros(head.hi - head.lo, head.dim, dtype=torch.float64)
    for start in range(0, items.size, IMPRINT_BLOCK):
        block = items[start:start + IMPRINT_BLOCK]
        features = F.normalize(embed(block).double().cpu(), dim=1)
        sums.index_add_(0, torch.from_numpy(labels[block] - head.lo), features)
    imprinted = new_local[sums[new_local].norm(dim=1) > 0]  # classes with training images
    if imprinted.numel():
        means = F.normalize(sums[imprinted], dim=1) * length
        head.set_rows(imprinted, means[:, None, :].expand(-1, head.subcentres, -1))
    return int(imprinted.numel()), int(items.size)


def neck_statistics(embed: Callable[[np.ndarray], torch.Tensor], count: int, dim: int, backend: Any,
                    device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The per-feature mean and biased variance (float64) of the ``dim``-wide embeddings of a fixed sample of the
    ``count`` training items: at most :data:`IMPRINT_BLOCK`, evenly spaced, split over the ranks and summed.

    The BNNeck normalises a training step's global batch of many classes; a rank's block of new images may hold
    one class, or one image, so imprinting normalises under these statistics instead: the same on every rank and
    at every world size (up to float summation order). ``device``: where the collective sums."""
    sample = np.unique(np.linspace(0, count - 1, min(count, IMPRINT_BLOCK)).round().astype(np.int64))
    mine = sample[backend.rank::backend.size]
    sums = torch.zeros(3, dim, dtype=torch.float64)
    if mine.size:
        features = embed(mine).double().cpu()
        sums[0], sums[1], sums[2] = features.sum(0), (features * features).sum(0), float(mine.size)
    if backend.size > 1:
        sums = backend.allreduce_sum(sums.to(device)).cpu()
    mean = sums[0] / sums[2]
    return mean, (sums[1] / sums[2] - mean * mean).clamp_min(0.0)


def _imprint(model: torch.nn.Module, loss_fn: HeadedLoss, plain_train: LabelledSubset, view: Any, backend: Any,
             train_labels: np.ndarray, new_local: torch.Tensor, length: float) -> tuple[int, int]:
    """Imprint the new rows of every rank (through the neck under :func:`neck_statistics` where there is one);
    (rows imprinted, images embedded) over all ranks."""
    def embedded(block: np.ndarray) -> torch.Tensor:
        return embed_rows(model, plain_train, block, backend, 128, 0, view)

    with torch.no_grad():
        stats = (neck_statistics(embedded, len(train_labels), loss_fn.head.dim, backend, loss_fn.head.rows.device)
                 if loss_fn.neck is not None and len(train_labels) else None)

        def embed(block: np.ndarray) -> torch.Tensor:
            return embedded(block) if stats is None else loss_fn.neck.fixed(embedded(block), *stats)

        counts = np.array(imprint_rows(loss_fn.head, embed, train_labels, new_local, length=length), dtype=np.int64)
    if backend.size > 1:
        counts = backend.allgather_numpy(counts).sum(axis=0)
    return int(counts[0]), int(counts[1])


def _raise(error: Exception | None) -> None:
    if error is not None:
        raise error


def _take_saved(path: str, model: torch.nn.Module, loss_fn: Any, names: Sequence[str]):
    """This rank's local part (no collective): the checkpoint read, the model and neck loaded, the kept rows
    copied. Returns the class record, the match, this rank's new rows (local indices; None without a head) and
    whether the checkpoint has a head."""
    state = _read(path)
    record = state["classes"]
    _load_model(model, state["model"], path)
    match = match_classes(record["names"], names)
    if not isinstance(loss_fn, HeadedLoss):
        return record, match, None, False
    saved_loss = state["loss"]
    if loss_fn.neck is not None and "neck" in saved_loss:
        _load_model(loss_fn.neck, saved_loss["neck"], path, "head.bnneck's neck")
    saved_head = saved_loss if "head" in saved_loss else None
    return record, match, _load_kept_rows(loss_fn.head, saved_head, match.saved_of, path), saved_head is not None


def continue_from(path: str, *, model: torch.nn.Module, loss_fn: Any, names: Sequence[str], train_labels: np.ndarray,
                  test_labels: np.ndarray, plain_train: LabelledSubset, view: Any, backend: Any,
                  rows: str = "imprint", agree: Callable[[Exception | None], None] = _raise) -> Continuation:
    """Start this run from checkpoint ``path`` (every rank calls it; see the module docstring).

    ``names``: today's class names by code; ``plain_train``: the training items without augmentation (the
    evaluation's transform) and ``view`` its device view, for imprinting. ``agree(error)``: a rank's failure to
    read or fit the checkpoint raised on every rank (the run mode's ``raise_together``) before any collective.
    """
    error = taken = None
    try:
        taken = _take_saved(path, model, loss_fn, names)
    except ConfigError as caught:
        error = caught
    agree(error)
    record, match, new_local, saved_has_head = taken
    saved_trained = np.asarray(record.get("trained", torch.zeros(0, dtype=torch.int64))).astype(np.int64)
    known = np.isin(match.saved_of, saved_trained) & (match.saved_of >= 0)
    now_held_out = int(np.count_nonzero(known[np.unique(np.asarray(test_labels, dtype=np.int64))]))
    if new_local is None:
        return Continuation(path, None, 0, 0, rows, known, now_held_out)
    imprinted = images = 0
    if rows == "imprint":
        length = _mean_length(loss_fn.head, known if saved_has_head else np.zeros_like(known), backend)
        imprinted, images = _imprint(model, loss_fn, plain_train, view, backend, np.asarray(train_labels), new_local,
                                     length)
    return Continuation(path, match, imprinted, images, rows, known, now_held_out, saved_has_head)
