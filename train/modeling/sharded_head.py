"""A classification head over 10⁶–10⁷ classes, its rows sharded over the ranks (Partial FC style).

Rank r of W holds a contiguous range of the global class ids (⌈C/W⌉ rows for
the first C mod W ranks, ⌊C/W⌋ after: :func:`row_range`), each row a
class centre (or ``subcentres`` of them, sub-centre ArcFace), small at the
start (:data:`INIT_STD`) and normalised only in the forward pass. A
step's loss is a margin softmax over a sampled set of classes:

* the step's positives (every class of the gathered global batch) always;
* negatives drawn by a hash of (seed, global step, class id) at the rate
  ``negatives / C`` (:func:`sampled`), so the sampled set is the same, bit for
  bit, at every world size: each rank evaluates the hash for its own rows.

Logits are ``scale * cos`` in fp32 with the margin on the target
(``arcface``: cos(θ + m), ``cosface``: cos θ − m, ``softmax``: none), the
margin 0 for ``softmax_steps`` and then ramped in; the scale defaults to
AdaCos's √2·ln(C − 1), bounded (:func:`derived_scale`). The
softmax needs no max all-reduce: logits lie in [−scale, scale], so
``exp(logit − scale)`` never overflows; the sum of exponentials and the target
logit are summed over ranks in fp64, once per step. Every rank then holds the
same loss; each rank's rows give a part of the embeddings' gradient, summed
over ranks in backward (:func:`pksampler.comm.sum_gradient`), after which it flows back
through the embeddings' all-gather like the pair loss's.

The head's rows are not ``nn.Parameter``\\ s: no data-parallel wrapper may
average them (each rank owns different rows) and no dense C/W-sized gradient
exists. A step leaves the gradient of its sampled rows in :attr:`pending`;
:class:`pksampler.train.solver.sparse_rows.SparseRowSGD` steps them through
:meth:`ShardedMarginHead.apply_update`. The host-memory plan is
:mod:`~pksampler.train.modeling.head_memory`'s.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch
from torch.nn import functional as F

from pksampler.comm import Collectives, sum_gradient, sum_over_ranks
from pksampler.hashing import splitmix64
from pksampler.samplers import rank_share
from pksampler.world import World
from pksampler.train.config.schema import MAX_HEAD_SCALE
from pksampler.train.modeling.head_memory import GATHER_BLOCK_BYTES
from pksampler.train.modeling.head_replicas import RangeCopy
from pksampler.train.modeling.lazy_decay import LazyDecay

__all__ = ["HEADS", "INIT_STD", "ShardedMarginHead", "derived_scale", "sampled", "row_range"]

#: ``head.name`` choices
HEADS = ("arcface", "cosface", "softmax")
_INIT_BLOCK = 4096  # classes per initialisation block (a fixed grid, independent of the world size)


#: the rows' initial standard deviation per coordinate (insightface Partial FC: N(0, 0.01)), so ‖w‖ ≈ 0.01·√D; the
#: rows are normalised only in the forward pass, and an SGD step turns a row by about lr/‖w‖², which makes
#: a small start a fast start (a unit-norm row learns about 100× slower at D = 128)
INIT_STD = 0.01
#: bounds of the scale derived from the number of classes (:func:`derived_scale`)
MIN_DERIVED_SCALE, MAX_DERIVED_SCALE = 10.0, 64.0


def derived_scale(num_classes: int) -> float:
    """AdaCos's fixed scale √2·ln(C − 1) (Zhang et al. 2019), bounded to [10, 64].

    9.3 at C = 700 and 19.5 at 10⁶; below 10 (C < 1,200) the bound holds it at 10 (the
    temperature 0.1 of normalised softmax, Zhai & Wu use 0.05), above it at insightface's 64.
    """
    if num_classes < 2:
        return MIN_DERIVED_SCALE
    value = math.sqrt(2.0) * math.log(num_classes - 1)
    return min(MAX_DERIVED_SCALE, max(MIN_DERIVED_SCALE, value))


def check_scale(scale: float) -> None:
    """Refuse a scale outside (0, MAX_HEAD_SCALE], naming ``head.scale``."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0.0 < scale <= MAX_HEAD_SCALE:
        raise ValueError(f"head.scale: must be in (0, {MAX_HEAD_SCALE:g}], got {scale!r} (the softmax "
                         "offsets logits by the scale in fp64; beyond the bound a row underflows to log(0))")


def row_range(num_classes: int, world: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[lo, hi)``: ⌈C/W⌉ for the first C mod W ranks, ⌊C/W⌋ after (the samplers' split,
    :func:`pksampler.samplers.rank_share`, as a range)."""
    lo, count = rank_share(num_classes, world, rank)
    return lo, lo + count


def sampled(class_ids: np.ndarray, *, seed: int, step: int, rate: float) -> np.ndarray:
    """Which of ``class_ids`` are this step's negatives: a hash of (seed, step, class id) below ``rate``.

    Depends on nothing else, so every world size draws the same set.
    """
    if rate >= 1.0:
        return np.ones(class_ids.shape, dtype=bool)
    with np.errstate(over="ignore"):
        key = splitmix64(np.array([seed], dtype=np.uint64))[0] ^ splitmix64(np.array([step], dtype=np.uint64))[0]
        hashed = splitmix64(class_ids.astype(np.uint64) ^ key)
    return (hashed >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53) < rate


class ShardedMarginHead(torch.nn.Module):
    """This rank's rows of a C-class margin-softmax head; ``head(embeddings, labels)`` is the step's loss.

    Args:
        num_classes: C, the global number of classes (labels are 0 … C − 1).
        dim: the embedding size D.
        collectives: a :class:`pksampler.comm.Collectives` (the trainer's backend).
        name: the margin kind (:data:`HEADS`).
        scale: s, logits are s·cos; None: :func:`derived_scale` of C.
        margin: m on the target (arcface: cos(θ + m), cosface: cos θ − m).
        negatives: expected sampled negative classes per step (all classes when >= C).
        subcentres: k centres per class, the nearest one used (sub-centre ArcFace).
        softmax_steps, margin_ramp_steps: the margin is 0 for the first ``softmax_steps`` global steps, then
            grows linearly to ``margin`` over ``margin_ramp_steps`` (insightface #214: softmax first, then the
            margin, when the margin head does not converge from scratch).
        seed: keys the initial rows and the negative draw.
        world: the rank's :class:`~pksampler.world.World` (its range, and the gradient scale the trainer's loss
            carries); None: the world the collectives carry (:meth:`World.of`; a backend's, with its loss scale).
        loss_weight: what the caller multiplies this head's loss by (``head.weight``): divided out of the rows'
            gradient, so the weight balances the losses in the network's gradient only and the rows learn at
            their own rate.

    The head owns its whole state: the rows and their momentum (buffers, this rank's range), the global step, the
    lazy weight decay's log (:class:`~pksampler.train.modeling.lazy_decay.LazyDecay`) and the gradient scale
    of the world it is in. An optimizer steps it through one method, :meth:`apply_update`, with an update rule
    (:func:`pksampler.train.solver.sparse_rows.momentum_sgd`); nothing else writes its fields.
    """

    def __init__(self, num_classes: int, dim: int, collectives: Collectives, *, name: str = "arcface",
                 scale: float | None = 30.0, margin: float = 0.3, negatives: int = 8192, subcentres: int = 1,
                 softmax_steps: int = 0, margin_ramp_steps: int = 0, seed: int = 0, world: World | None = None,
                 loss_weight: float = 1.0) -> None:
        super().__init__()
        if name not in HEADS:
            raise ValueError(f"head.name must be one of {list(HEADS)}, got {name!r}")
        scale = derived_scale(num_classes) if scale is None else scale
        check_scale(scale)
        self.name, self.scale, self.margin, self.negatives, self.subcentres = name, float(scale), margin, negatives, subcentres
        self.softmax_steps, self.margin_ramp_steps = softmax_steps, margin_ramp_steps
        self.num_classes, self.dim, self.collectives, self.seed = num_classes, dim, collectives, seed
        self.loss_weight = loss_weight
        world = world if world is not None else World.of(collectives)
        self.lo, self.hi = row_range(num_classes, world.size, world.rank)
        self.gradient_scale = world.loss_scale  # the factor the trainer's loss carries into backward (Horovod: W)
        self.register_buffer("rows", self.initial_rows(), persistent=False)
        self.register_buffer("momentum", torch.zeros_like(self.rows), persistent=False)
        self.decay = LazyDecay(self.hi - self.lo)
        self.step = 0  # global steps taken: keys the negative draw and the margin's ramp
        # the last step's margin and its loss without the margin (diagnostics for the step record)
        self.last_margin, self.last_softmax_loss = 0.0, torch.zeros(())
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (row ids, sampled rows with .grad)

    def initial_rows(self) -> torch.Tensor:
        """Rows keyed by class id, so the head starts the same at every world size: N(0, INIT_STD²) each coordinate.

        Classes come in fixed blocks of ``_INIT_BLOCK`` ids, each drawn from a
        generator keyed by (seed, block); a rank draws the blocks its range
        overlaps and keeps its rows. They are not normalised: the forward pass
        normalises them, and their small length is what lets SGD turn them fast.
        """
        k, block = self.subcentres, _INIT_BLOCK
        rows = torch.empty(self.hi - self.lo, k, self.dim)
        for first in range(self.lo - self.lo % block, self.hi, block):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + first // block)
            drawn = torch.randn(block, k, self.dim, generator=generator)
            lo, hi = max(first, self.lo), min(first + block, self.hi)
            rows[lo - self.lo:hi - self.lo] = drawn[lo - first:hi - first]
        return rows * INIT_STD

    def margin_now(self) -> float:
        """The margin at this global step: 0 during the softmax phase (and always for ``softmax``, which applies
        none), then a linear ramp to ``margin``."""
        into = self.step - self.softmax_steps
        if into < 0 or self.name == "softmax":
            return 0.0
        if self.margin_ramp_steps <= 0 or into >= self.margin_ramp_steps:
            return self.margin
        return self.margin * (into + 1) / self.margin_ramp_steps

    def selection(self, labels: torch.Tensor) -> torch.Tensor:
        """This rank's sampled rows (local indices): the batch's classes in range, then the hashed negatives."""
        ids = np.arange(self.lo, self.hi)
        rate = min(1.0, self.negatives / max(self.num_classes, 1))
        chosen = sampled(ids, seed=self.seed, step=self.step, rate=rate)
        positives = labels.cpu().numpy()
        positives = positives[(positives >= self.lo) & (positives < self.hi)] - self.lo
        chosen[positives] = True
        return torch.from_numpy(np.flatnonzero(chosen)).to(self.rows.device)

    def _target_cosine(self, cosine: torch.Tensor) -> torch.Tensor:
        margin = self.last_margin
        if self.name == "cosface":
            return cosine - margin
        if self.name == "arcface" and margin:
            theta = torch.acos(cosine.clamp(-1 + 1e-7, 1 - 1e-7))
            return torch.cos(theta + margin)
        return cosine

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The margin softmax cross-entropy of the (gathered) batch over the sampled classes; same on every rank."""
        self.last_margin = self.margin_now()  # this step's (read by _target_cosine and the step record)
        chosen = self.selection(labels)
        self._settle(chosen)  # the gradient of a normalised row depends on its length: read it decayed
        sampled_rows = self.rows[chosen].detach().requires_grad_(True)
        self.pending = (chosen, sampled_rows)
        features = F.normalize(sum_gradient(embeddings.float(), self.collectives), dim=1)
        cosine = torch.einsum("nd,skd->nsk", features, F.normalize(sampled_rows, dim=2)).amax(dim=2)
        local = labels.to(chosen.device) - self.lo
        position = torch.searchsorted(chosen, local.clamp(0, max(self.hi - self.lo - 1, 0)))
        position = position.clamp(max=max(chosen.numel() - 1, 0))
        mine = (local >= 0) & (local < self.hi - self.lo) & (chosen.numel() > 0)
        if chosen.numel():
            mine = mine & (chosen[position] == local)
        target = torch.zeros_like(labels, dtype=torch.float32, device=cosine.device)
        plain = torch.zeros_like(target)  # the target's logit without the margin (its owner's; 0 elsewhere)
        logits = self.scale * cosine
        if chosen.numel():
            picked = cosine.gather(1, position[:, None]).squeeze(1)
            target_logit = self.scale * self._target_cosine(picked)
            target = torch.where(mine, target_logit, target)
            plain = torch.where(mine, self.scale * picked, plain).detach()
            # the owner's target leaves the sum and is added back after the all-reduce, with or without its margin:
            # taking it out again would cancel (past π, arcface lifts a far target e^100 above every other term)
            logits = logits.scatter(1, position[:, None],
                                    torch.where(mine, float("-inf"), picked * self.scale)[:, None])
        others = torch.exp(logits.double() - self.scale).sum(dim=1)
        summed = sum_over_ranks(torch.stack([others, target.double(), plain.double()], dim=1), self.collectives)
        loss = torch.log(summed[:, 0] + torch.exp(summed[:, 1] - self.scale)) + self.scale - summed[:, 1]
        self.last_softmax_loss = self._margin_free(summed.detach())
        return loss.mean().float()

    def _margin_free(self, summed: torch.Tensor) -> torch.Tensor:
        """The same step's cross-entropy with the margin left out (the target's logit s·cos θ in the sum instead
        of the margin's): comparable across the margin's ramp and with ln C, from the one all-reduce."""
        others, _, plain = summed.unbind(dim=1)
        return (torch.log(others + torch.exp(plain - self.scale)) + self.scale - plain).mean().float()

    # --- state: the whole head, keyed by class id, the same at every world size ---------------------------
    def gather_rows(self, local: torch.Tensor, *, everywhere: bool = False) -> torch.Tensor | None:
        """Every rank's rows of ``local`` (this rank's ``(rows, ...)`` tensor) in class order, on the host.

        By default only rank 0 receives them (None elsewhere), gathered in blocks of about
        ``GATHER_BLOCK_BYTES`` per collective, so the other ranks hold one block at a time, not the whole head
        (at 10⁷ × 128 classes that is 9.5 GiB per rank less at a checkpoint). ``everywhere``: one all-gather,
        every rank receives the whole head.
        """
        if self.collectives.size == 1:
            return local.cpu()
        if everywhere:
            return self.collectives.allgather(local.contiguous()).cpu()
        world, rank = self.collectives.size, self.collectives.rank
        ranges = [row_range(self.num_classes, world, r) for r in range(world)]
        row_bytes = max(1, local[:1].numel() * local.element_size())
        block = max(1, GATHER_BLOCK_BYTES // (world * row_bytes))
        longest = max(hi - lo for lo, hi in ranges)
        out = torch.empty((self.num_classes, *local.shape[1:]), dtype=local.dtype) if rank == 0 else None
        for start in range(0, longest, block):
            rows = min(block, longest - start)
            mine = local[start:start + rows]
            padded = torch.zeros((rows, *local.shape[1:]), dtype=local.dtype, device=local.device)
            padded[:mine.shape[0]] = mine
            gathered = self.collectives.allgather(padded)
            if out is not None:
                for r, (lo, hi) in enumerate(ranges):
                    take = max(0, min(rows, hi - lo - start))
                    out[lo + start:lo + start + take] = gathered[r * rows:r * rows + take].cpu()
            del gathered
        return out

    # --- the row update (an optimizer calls this one method) -----------------------------------------------
    def _settle(self, chosen: torch.Tensor) -> None:
        """Apply the pending weight decay of rows ``chosen`` (before a step reads them)."""
        factor = self.decay.take(chosen.cpu())
        self.rows[chosen] *= factor.to(device=self.rows.device, dtype=self.rows.dtype)[:, None, None]

    def settle(self) -> None:
        """Apply every row's pending weight decay (then the rows are the eager optimizer's)."""
        self.rows.mul_(self.decay.take().to(device=self.rows.device, dtype=self.rows.dtype)[:, None, None])

    def apply_update(self, update: Callable[..., tuple[torch.Tensor, torch.Tensor]], *, lr: float,
                     weight_decay: float = 0.0, grad_scale: float = 1.0, skipped: bool = False) -> None:
        """Step the rows the last forward sampled: ``update(rows, momentum, grad, lr=lr)`` gives their new rows
        and momentum (:func:`pksampler.train.solver.sparse_rows.momentum_sgd`), after the step's decoupled
        decay ``1 − lr·weight_decay``; every other row owes that decay until it is read (:class:`LazyDecay`).

        The gradient is divided by the world's gradient scale, ``grad_scale`` (the GradScaler's factor, fp16;
        1 without one) and :attr:`loss_weight`. ``skipped`` (the GradScaler found an overflow in the reduced dense
        gradients, the same decision on every rank): no update and no decay; the step still counts."""
        pending, self.pending = self.pending, None
        grad = None
        if skipped:
            lr = 0.0
        elif pending is not None and pending[1].grad is not None:
            grad = pending[1].grad / (self.gradient_scale * grad_scale * self.loss_weight)
        self.decay.record(lr * weight_decay)
        self.step += 1
        if grad is None:
            return
        chosen = pending[0]
        factor = self.decay.take(chosen.cpu()).to(device=self.rows.device, dtype=self.rows.dtype)
        rows, momentum = update(self.rows[chosen] * factor[:, None, None], self.momentum[chosen], grad, lr=lr)
        self.momentum[chosen] = momentum
        self.rows[chosen] = rows

    # --- state: the whole head keyed by class id (checkpoints), or this rank's range (Horovod elastic) ------
    def whole_state(self, *, everywhere: bool = False) -> dict[str, Any]:
        """Rows and momentum of the whole head, keyed by class id, decay settled (a collective: every rank calls
        it). Gathered to rank 0 in blocks (``rows`` and ``momentum`` are None on the others), or to every rank
        with ``everywhere`` (one all-gather; see :meth:`gather_rows`)."""
        self.settle()
        return {"rows": self.gather_rows(self.rows, everywhere=everywhere),
                "momentum": self.gather_rows(self.momentum, everywhere=everywhere), "step": self.step,
                "num_classes": self.num_classes, "subcentres": self.subcentres, "dim": self.dim,
                "log_decay": self.decay.log.clone(), "momentum_of_own_loss": True}

    def check_whole(self, saved: dict[str, Any]) -> None:
        """Refuse, in one line naming the field, a :meth:`whole_state` (a checkpoint's, maybe edited by hand) that
        this head cannot take whole: rows and momentum of shape (C, k, D) (a smaller momentum would broadcast over
        every class), a 1-D decay log."""
        self._check_tensors(saved, self.num_classes)

    def _check_tensors(self, saved: dict[str, Any], rows: int) -> None:
        """Refuse saved ``rows`` and ``momentum`` not of shape (``rows``, k, D), or a decay log not 1-D."""
        shape = (rows, self.subcentres, self.dim)
        for field in ("rows", "momentum"):
            if tuple(saved[field].shape) != shape:
                raise ValueError(f"the checkpoint's head has {field} of shape {tuple(saved[field].shape)}, this "
                                 f"run's {shape} (head.subcentres, model.embedding_dim and the classes must match)")
        if saved["log_decay"].dim() != 1 or saved["log_decay"].numel() < 1:
            raise ValueError(f"the checkpoint's head has a log_decay of shape {tuple(saved['log_decay'].shape)}, "
                             "expected one value per step taken (1-D, at least the start)")

    def load_whole(self, saved: dict[str, Any]) -> None:
        """:meth:`whole_state`'s head, this rank's range of it. A head saved before the rows stepped on their
        own loss (no ``momentum_of_own_loss``) holds momentum of ``head.weight`` × that loss: divided back, so
        it continues in the units of the rule now in force."""
        self.check_whole(saved)
        self.rows.copy_(saved["rows"][self.lo:self.hi])
        momentum = saved["momentum"][self.lo:self.hi]
        self.momentum.copy_(momentum if saved.get("momentum_of_own_loss") else momentum / self.loss_weight)
        self.step = int(saved["step"])
        self.decay.load(saved["log_decay"])

    def check_saved(self, saved: dict[str, Any], shape: tuple[int, ...] | None = None) -> None:
        """Refuse a saved head (``shape``: its rows'; else its recorded classes, subcentres and dimension) whose
        rows are not this head's, naming both shapes."""
        mine = (self.num_classes, self.subcentres, self.dim)
        shape = shape if shape is not None else (saved.get("num_classes"), saved.get("subcentres"), saved.get("dim"))
        if tuple(shape) != mine:
            raise ValueError(f"the checkpoint's head has rows of shape {tuple(shape)}, this run's {mine} "
                             "(head.subcentres, model.embedding_dim and the classes must match)")

    def range_state(self, *, copy: bool = True) -> tuple[dict[str, Any], RangeCopy]:
        """Horovod elastic's commit of this rank (no collective): the head's state but its rows and momentum
        (``meta``, the same on every rank), and a host copy of this rank's rows and momentum, decay settled.
        ``copy=False`` (a checkpoint, written before the loop goes on): rows already on the host are not
        copied."""
        self.settle()
        meta = {"step": self.step, "num_classes": self.num_classes, "subcentres": self.subcentres, "dim": self.dim,
                "log_decay": self.decay.log.clone()}
        return meta, RangeCopy(self.lo, self.hi, (self.rows.detach().to("cpu", copy=copy),
                                                  self.momentum.detach().to("cpu", copy=copy)))

    def load_range(self, meta: dict[str, Any], fill: Callable[..., None]) -> None:
        """This rank's range written by ``fill(rows, momentum)`` (an assembly), then :meth:`range_state`'s
        ``meta`` (every row settled)."""
        fill(self.rows, self.momentum)
        self.step = int(meta["step"])
        self.decay.load(meta["log_decay"])

    def get_extra_state(self) -> dict[str, Any]:
        """nn.Module's ``state_dict`` entry of the head: this rank's range (``start``, ``stop``; rows and momentum,
        decay settled), the global step and the decay log. A checkpoint that any W loads is :meth:`whole_state`
        or the range files (:mod:`~pksampler.train.modeling.range_checkpoint`)."""
        meta, own = self.range_state()
        rows, momentum = own.tensors
        return {**meta, "start": own.lo, "stop": own.hi, "rows": rows, "momentum": momentum}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """:meth:`get_extra_state`'s range, into a head that owns the same range (refused in one line otherwise,
        as are rows, momentum or a decay log of another shape, before anything is written)."""
        self.check_saved(state)
        if (int(state["start"]), int(state["stop"])) != (self.lo, self.hi):
            raise ValueError(f"the saved head holds rows {state['start']}-{state['stop']}, this rank owns "
                             f"{self.lo}-{self.hi}: a module state loads at its own world size and rank (any W "
                             "loads whole_state() or a checkpoint's range files)")
        self._check_tensors(state, self.hi - self.lo)
        self.load_range(state, lambda rows, momentum: (rows.copy_(state["rows"]), momentum.copy_(state["momentum"])))

    def set_rows(self, local: torch.Tensor, values: torch.Tensor) -> None:
        """Rows ``local`` (indices into this rank's range) become ``values`` (a continued run's kept and imprinted
        rows, ``train.init_from``); their momentum is left as it is."""
        self.rows[local.to(self.rows.device)] = values.to(self.rows)

    def load_initial(self) -> None:
        """The initial rows of this rank's range (a new world before any step was committed)."""
        if self.decay.steps != 0:
            raise RuntimeError(f"the sharded head took {self.decay.steps} steps but has no committed copy to "
                               "re-shard from")
        self.rows.copy_(self.initial_rows())

    def set_world(self, world: World) -> None:
        """Take this rank's range in ``world`` and its gradient scale (a Horovod elastic reset: the world protocol).

        Rows and momentum are zero until a whole head is loaded (:meth:`load_whole`), a range assembled
        (:meth:`load_range`) or the initial rows taken (:meth:`load_initial`).
        """
        self.lo, self.hi = row_range(self.num_classes, world.size, world.rank)
        self.gradient_scale = world.loss_scale
        self.rows = self.rows.new_zeros(self.hi - self.lo, self.subcentres, self.dim)  # the rows' dtype and device
        self.momentum = torch.zeros_like(self.rows)
        self.decay.resize(self.hi - self.lo)
        self.pending = None

    def memory_bytes(self) -> int:
        """Bytes of this rank's rows (C·k·D/W floats)."""
        return self.rows.numel() * self.rows.element_size()

