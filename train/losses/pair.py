"""Metric-learning losses on L2-normalised embeddings of a (global) batch.

All losses are means over anchors of the whole batch they are given, so with
gathered embeddings every rank computes the same value as one process with
the global batch.

Two families share one entry point, :func:`build_loss`:

* the built-in losses of :data:`LOSSES` (their names are the config's
  choices, :func:`loss_names`);
* any loss of pytorch-metric-learning, named ``pml.<ClassName>`` (for example
  ``pml.TripletMarginLoss``), optionally with a pml miner
  (``pml.MultiSimilarityMiner``). The package is imported only when such a
  name is used (extra ``pksampler[pml]``).

The pair losses (``batch_hard``, ``multi_similarity``, ``contrastive`` and
every ``pml.*`` loss that accepts ``ref_emb``) also take reference
embeddings from a cross-batch memory (:mod:`pksampler.train.losses.memory`): each
anchor of the batch is compared with the other batch items *and* the
references, which only ever stand on the other side of a pair and get no
gradient (XBM, Wang et al. 2020).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Mapping

import torch
from torch.nn import functional as F

from pksampler.train.losses.memory import CrossBatchMemory

__all__ = [
    "LOSSES",
    "PML_PREFIX",
    "MetricLoss",
    "batch_hard_triplet",
    "build_loss",
    "build_miner",
    "check_loss_name",
    "contrastive",
    "loss_names",
    "multi_similarity",
    "triplet",
]

PML_PREFIX = "pml."


def _distances_from_similarities(sim: torch.Tensor) -> torch.Tensor:
    """Euclidean distances of unit vectors, with a floor inside the square root so gradients stay finite."""
    return torch.sqrt((2.0 - 2.0 * sim).clamp_min(0.0) + 1e-12)


def _against(embeddings: torch.Tensor, labels: torch.Tensor, ref_embeddings: torch.Tensor | None,
             ref_labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cosine similarities of every anchor to the batch followed by the references, and pair masks.

    Returns ``(sim, positive, negative)``, each ``(B, B + M)``: the first B
    columns are the batch (the anchor itself excluded from its positives),
    the last M the references, detached so the memory gets no gradient.
    """
    others, other_labels = embeddings, labels
    if (ref_embeddings is None) != (ref_labels is None):
        raise ValueError("ref_embeddings and ref_labels must be given together (both or neither)")
    if ref_embeddings is not None and ref_labels is not None:
        if ref_embeddings.ndim != 2 or ref_embeddings.shape[1] != embeddings.shape[1]:
            raise ValueError(f"ref_embeddings must have shape (M, {embeddings.shape[1]}), "
                             f"got {tuple(ref_embeddings.shape)}")
        if ref_labels.shape != (ref_embeddings.shape[0],):
            raise ValueError(f"ref_labels must have shape ({ref_embeddings.shape[0]},), got {tuple(ref_labels.shape)}")
        if ref_embeddings.shape[0]:
            others = torch.cat([embeddings, ref_embeddings.detach().to(embeddings.device, embeddings.dtype)])
            other_labels = torch.cat([labels, ref_labels.to(labels.device, labels.dtype)])
    sim = embeddings @ others.T
    same = labels[:, None] == other_labels[None, :]
    rows = torch.arange(labels.shape[0], device=labels.device)
    itself = torch.zeros_like(same)
    itself[rows, rows] = True
    return sim, same & ~itself, ~same


def batch_hard_triplet(embeddings: torch.Tensor, labels: torch.Tensor, margin: float | str = "soft", *,
                       ref_embeddings: torch.Tensor | None = None,
                       ref_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-hard triplet loss (Hermans, Beyer, Leibe 2017).

    For each anchor: its farthest positive and nearest negative among the
    batch and the references; ``softplus(d_ap - d_an)`` for ``margin="soft"``,
    else ``relu(d_ap - d_an + margin)``. Anchors without a positive or a
    negative are left out.
    """
    sim, positive, negative = _against(embeddings, labels, ref_embeddings, ref_labels)
    dist = _distances_from_similarities(sim)
    hardest_positive = torch.where(positive, dist, torch.zeros_like(dist)).max(dim=1).values
    hardest_negative = torch.where(negative, dist, torch.full_like(dist, float("inf"))).min(dim=1).values
    valid = positive.any(dim=1) & negative.any(dim=1)
    if not valid.any():
        return embeddings.sum() * 0.0
    gap = hardest_positive[valid] - hardest_negative[valid]
    losses = F.softplus(gap) if margin == "soft" else F.relu(gap + float(margin))
    return losses.mean()


def multi_similarity(embeddings: torch.Tensor, labels: torch.Tensor, alpha: float = 2.0, beta: float = 50.0,
                     base: float = 0.5, epsilon: float = 0.1, *, ref_embeddings: torch.Tensor | None = None,
                     ref_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-similarity loss with its pair mining (Wang et al. 2019), on cosine similarities.

    The pairs of each anchor are mined among the batch and the references.
    """
    sim, positive, negative = _against(embeddings, labels, ref_embeddings, ref_labels)
    big = torch.finfo(sim.dtype).max
    min_positive = torch.where(positive, sim, torch.full_like(sim, big)).min(dim=1, keepdim=True).values
    max_negative = torch.where(negative, sim, torch.full_like(sim, -big)).max(dim=1, keepdim=True).values
    mined_negative = negative & (sim + epsilon > min_positive)
    mined_positive = positive & (sim - epsilon < max_negative)
    pos_term = torch.log1p(torch.where(mined_positive, torch.exp(-alpha * (sim - base)), torch.zeros_like(sim)).sum(1)) / alpha
    neg_term = torch.log1p(torch.where(mined_negative, torch.exp(beta * (sim - base)), torch.zeros_like(sim)).sum(1)) / beta
    valid = positive.any(dim=1) & negative.any(dim=1)
    if not valid.any():
        return embeddings.sum() * 0.0
    return (pos_term + neg_term)[valid].mean()


def contrastive(embeddings: torch.Tensor, labels: torch.Tensor, pos_margin: float = 0.0,
                neg_margin: float = 0.8, *, ref_embeddings: torch.Tensor | None = None,
                ref_labels: torch.Tensor | None = None) -> torch.Tensor:
    """Contrastive loss (Hadsell et al. 2006): pull positives within ``pos_margin``, push negatives past ``neg_margin``.

    The mean runs over every (anchor, other) pair, the others being the batch and the references.
    """
    sim, positive, negative = _against(embeddings, labels, ref_embeddings, ref_labels)
    dist = _distances_from_similarities(sim)
    pos = F.relu(dist - pos_margin).pow(2)[positive]
    neg = F.relu(neg_margin - dist).pow(2)[negative]
    terms = torch.cat([pos, neg])
    return terms.mean() if terms.numel() else embeddings.sum() * 0.0


def triplet(embeddings: torch.Tensor, labels: torch.Tensor, margin: float | str = 0.2) -> torch.Tensor:
    """Triplet loss on rows laid out as (anchor, positive, negative) triples."""
    if embeddings.shape[0] % 3:
        raise ValueError(f"triplet loss expects a multiple of 3 rows, got {embeddings.shape[0]}")
    a, p, n = embeddings[0::3], embeddings[1::3], embeddings[2::3]
    gap = (a - p).norm(dim=1) - (a - n).norm(dim=1)
    return (F.softplus(gap) if margin == "soft" else F.relu(gap + float(margin))).mean()


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "batch_hard": batch_hard_triplet,
    "multi_similarity": multi_similarity,
    "contrastive": contrastive,
    "triplet": triplet,
}
"""The built-in losses by config name; the keys are the choices of ``loss.name`` (besides ``pml.*``)."""


def loss_names() -> tuple[str, ...]:
    """The built-in choices of ``loss.name``; any ``pml.<LossClass>`` is accepted besides them."""
    return tuple(LOSSES)


def check_loss_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a built-in loss or looks like ``pml.<LossClass>``.

    Only the spelling is checked (no import), so a config can be validated
    where pytorch-metric-learning is not installed; :func:`build_loss` checks
    that the class exists.
    """
    if not isinstance(name, str):
        raise TypeError(f"loss.name must be a string, got {type(name).__name__} {name!r}")
    if name in LOSSES:
        return
    if name.startswith(PML_PREFIX) and name[len(PML_PREFIX):].isidentifier():
        return
    raise ValueError(f"loss.name must be one of {sorted(LOSSES)} or '{PML_PREFIX}<LossClass>' "
                     f"(a pytorch-metric-learning loss), got {name!r}")


def _uses_references(function: Callable[..., torch.Tensor]) -> bool:
    return "ref_embeddings" in inspect.signature(function).parameters


def _pml_object(kind: str, name: str, args: Mapping[str, Any], key: str) -> Any:
    """Construct ``pytorch_metric_learning.<kind>.<Class>(**args)`` for ``name = 'pml.<Class>'``.

    ``kind`` is ``losses`` or ``miners``; ``key`` is the config key to name in
    errors (``loss`` or ``loss.miner``). The package is imported here, lazily.
    """
    try:
        module = importlib.import_module(f"pytorch_metric_learning.{kind}")
    except ImportError as error:  # pragma: no cover - the dev extra installs it
        raise ImportError(f"{key}.name {name!r} needs pytorch-metric-learning: "
                          "pip install 'pksampler[pml]'") from error
    base = module.BaseMetricLossFunction if kind == "losses" else module.BaseMiner
    available = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, base)
                       and not n.startswith("Base"))
    class_name = name[len(PML_PREFIX):]
    if not name.startswith(PML_PREFIX) or class_name not in available:
        what = "loss" if kind == "losses" else "miner"
        raise ValueError(f"{key}.name {name!r}: pytorch-metric-learning has no {what} class {class_name!r}; "
                         f"choose one of {[PML_PREFIX + n for n in available]}")
    try:
        return getattr(module, class_name)(**args)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{key}.args {dict(args)!r} do not fit {name}: {error}") from error


def _check_args(args: Any, key: str) -> dict[str, Any]:
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise TypeError(f"{key}.args must be a mapping of argument names to values, got {args!r}")
    return dict(args)


def build_miner(name: str, args: Mapping[str, Any] | None = None) -> Any:
    """A pytorch-metric-learning miner from ``loss.miner: {name: pml.<MinerClass>, args: {...}}``.

    Only pml miners exist: the built-in losses mine their own pairs.
    """
    if not isinstance(name, str) or not name.startswith(PML_PREFIX):
        raise ValueError(f"loss.miner.name must be '{PML_PREFIX}<MinerClass>' (a pytorch-metric-learning "
                         f"miner), got {name!r}")
    return _pml_object("miners", name, _check_args(args or {}, "loss.miner"), "loss.miner")


def _drop_self_pairs(indices: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Remove (i, i) positive pairs: with references ``[batch; memory]`` anchor i is also reference i."""
    if len(indices) == 3:
        a, p, n = indices
        keep = a != p
        return a[keep], p[keep], n[keep]
    a1, p, a2, n = indices
    keep = a1 != p
    return a1[keep], p[keep], a2, n


class MetricLoss:
    """``loss(embeddings, labels) -> Tensor`` as built by :func:`build_loss`.

    With a memory, each call (1) reads the memory's references (none during
    its warm-up), (2) computes the loss of the batch against batch +
    references, (3) enqueues the batch, detached. The batch is enqueued after
    the loss, so an anchor never meets its own detached copy. Call it once
    per (micro-)batch, on the gathered global batch.
    """

    def __init__(self, name: str, function: Callable[..., torch.Tensor], *, miner: Any = None,
                 memory: CrossBatchMemory | None = None, pml: bool = False) -> None:
        self.name = name
        self.function = function
        self.miner = miner
        self.memory = memory
        self._pml = pml

    def __repr__(self) -> str:
        return f"MetricLoss({self.name!r}, miner={self.miner!r}, memory={self.memory!r})"

    def parameters(self) -> list[torch.nn.Parameter]:
        """Trainable parameters of the loss (proxy and classifier losses such as ``pml.ArcFaceLoss``).

        The optimizer must include them; the built-in losses have none.
        """
        return list(self.function.parameters()) if isinstance(self.function, torch.nn.Module) else []

    def to(self, device: torch.device | str) -> "MetricLoss":
        """Move the loss's parameters, the miner and the memory to ``device``; returns self."""
        for part in (self.function, self.miner, self.memory):
            if isinstance(part, (torch.nn.Module, CrossBatchMemory)):
                part.to(device)
        return self

    def state_dict(self) -> dict[str, Any]:
        """The loss's parameters and the memory's queue: tensors and plain data only."""
        return {
            "loss": self.function.state_dict() if isinstance(self.function, torch.nn.Module) else {},
            "memory": self.memory.state_dict() if self.memory is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; a memory present on one side only is an error naming ``loss.memory``."""
        if (self.memory is None) != (state.get("memory") is None):
            raise ValueError("loss.memory: the checkpoint " + ("has no" if state.get("memory") is None else "has a")
                             + " cross-batch memory, the configuration " + ("has none" if self.memory is None
                                                                            else "has one"))
        if isinstance(self.function, torch.nn.Module):
            self.function.load_state_dict(state["loss"])
        if self.memory is not None:
            self.memory.load_state_dict(state["memory"])

    def __call__(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ref_embeddings = ref_labels = None
        if self.memory is not None:
            ref_embeddings, ref_labels = self.memory.references()
            if ref_embeddings.shape[0] == 0:
                ref_embeddings = ref_labels = None
        value = (self._pml_loss(embeddings, labels, ref_embeddings, ref_labels) if self._pml
                 else self._builtin_loss(embeddings, labels, ref_embeddings, ref_labels))
        if self.memory is not None:
            self.memory.enqueue(embeddings, labels)
        return value

    def _builtin_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, ref_embeddings: torch.Tensor | None,
                      ref_labels: torch.Tensor | None) -> torch.Tensor:
        if ref_embeddings is None:
            return self.function(embeddings, labels)
        return self.function(embeddings, labels, ref_embeddings=ref_embeddings, ref_labels=ref_labels)

    def _pml_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, ref_embeddings: torch.Tensor | None,
                  ref_labels: torch.Tensor | None) -> torch.Tensor:
        if ref_embeddings is None:
            indices = self.miner(embeddings, labels) if self.miner is not None else None
            return self.function(embeddings, labels, indices)
        # References [batch; memory]: batch pairs keep their gradient on both
        # sides, as without a memory; the memory part is detached. pml only
        # drops self pairs when ref is the batch itself, so they are dropped here.
        from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

        refs = torch.cat([embeddings, ref_embeddings.detach().to(embeddings.device, embeddings.dtype)])
        refs_labels = torch.cat([labels, ref_labels.to(labels.device, labels.dtype)])
        if self.miner is not None:
            indices = self.miner(embeddings, labels, refs, refs_labels)
        else:
            indices = lmu.get_all_pairs_indices(labels, refs_labels)
        try:
            return self.function(embeddings, labels, _drop_self_pairs(indices), refs, refs_labels)
        except ValueError as error:
            if "ref_emb" in str(error):
                raise ValueError(f"loss.memory: {self.name} does not accept reference embeddings "
                                 f"({error}); use another loss or loss.memory: null") from error
            raise


def _spec(miner: Any) -> tuple[str, Mapping[str, Any]]:
    """(name, args) of a miner spec: a mapping ``{name, args}`` or an object with ``.name`` / ``.args``."""
    if isinstance(miner, Mapping):
        unknown = sorted(set(miner) - {"name", "args"})
        if unknown or "name" not in miner:
            raise ValueError(f"loss.miner must be {{name: pml.<MinerClass>, args: {{...}}}}, got {dict(miner)!r}")
        return miner["name"], miner.get("args") or {}
    if hasattr(miner, "name"):
        return miner.name, getattr(miner, "args", None) or {}
    raise TypeError(f"loss.miner must be a mapping {{name, args}} or a config with .name/.args, got {miner!r}")


def _probe(name: str, function: Callable[..., torch.Tensor], arguments: Mapping[str, Any]) -> None:
    """Call a built-in loss once on six 2-D embeddings, so a wrong-typed argument fails at set-up, named.

    Six rows are two (anchor, positive, negative) triplets as well as a batch
    with two samples of each class, so both the pair and the triplet losses accept it.
    """
    embeddings = torch.nn.functional.normalize(torch.tensor(
        [[1.0, 0.2], [0.9, 0.3], [0.1, 1.0], [0.2, 0.8], [0.3, 0.9], [0.8, 0.1]]), dim=1)
    try:
        function(embeddings, torch.tensor([0, 0, 1, 1, 1, 0]), **arguments)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"loss.args: {dict(arguments)!r} do not suit loss {name!r} ({type(error).__name__}: "
                         f"{error})") from None


def build_loss(name: str, args: Mapping[str, Any] | None = None, miner: Any = None,
               memory: CrossBatchMemory | None = None) -> MetricLoss:
    """``loss(embeddings, labels)`` for the config block ``loss: {name, args, miner, memory}``.

    Args:
        name: a key of :data:`LOSSES` or ``pml.<LossClass>``.
        args: keyword arguments of the loss; an unknown one is an error naming ``loss.args``.
        miner: ``{name: pml.<MinerClass>, args: {...}}`` (or a config object
            with ``name``/``args``); only with a ``pml.*`` loss.
        memory: a :class:`~pksampler.train.losses.memory.CrossBatchMemory` (see
            :func:`~pksampler.train.losses.memory.build_memory`); only with a pair loss.

    Example::

        loss = build_loss("pml.TripletMarginLoss", {"margin": 0.1},
                          miner={"name": "pml.MultiSimilarityMiner", "args": {"epsilon": 0.1}})
        value = loss(embeddings, labels)
    """
    check_loss_name(name)
    arguments = _check_args(args or {}, "loss")
    if memory is not None and not isinstance(memory, CrossBatchMemory):
        raise TypeError(f"memory must be a CrossBatchMemory or None, got {type(memory).__name__}")
    if name.startswith(PML_PREFIX):
        function = _pml_object("losses", name, arguments, "loss")
        built_miner = build_miner(*_spec(miner)) if miner is not None else None
        return MetricLoss(name, function, miner=built_miner, memory=memory, pml=True)

    function = LOSSES[name]
    accepted = [p.name for p in list(inspect.signature(function).parameters.values())[2:]
                if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    unknown = sorted(set(arguments) - set(accepted))
    if unknown:
        raise ValueError(f"loss.args: unknown argument {unknown[0]!r} for loss {name!r} (accepted: {accepted})")
    if miner is not None:
        raise ValueError(f"loss.miner: a miner needs a '{PML_PREFIX}*' loss; the built-in loss {name!r} "
                         f"mines its own pairs (got miner {miner!r})")
    if memory is not None and not _uses_references(function):
        raise ValueError(f"loss.memory: loss {name!r} takes no reference embeddings; use one of "
                         f"{sorted(n for n, f in LOSSES.items() if _uses_references(f))} or a pml.* loss")

    _probe(name, function, arguments)

    def bound(embeddings: torch.Tensor, labels: torch.Tensor, **references: Any) -> torch.Tensor:
        return function(embeddings, labels, **arguments, **references)

    return MetricLoss(name, bound, memory=memory)
