"""The pair loss with a row-sharded margin head beside it (``head:``), built from the config in one call.

:meth:`HeadedLoss.from_config` is the whole head recipe (``head.*``; see
docs/sharded-head.md): a :class:`~pksampler.train.modeling.sharded_head.ShardedMarginHead`
with small rows and a scale derived from the number of classes, the optional
BNNeck and the weights of the two losses in the network's gradient. The rows'
optimizer (:class:`~pksampler.train.solver.sparse_rows.SparseRowSGD`) is built
by the caller: the solver sits above the losses in the layering, and the state
it steps is the head's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from pksampler.world import World

from pksampler.train.errors import ConfigError
from pksampler.train.modeling.bnneck import BNNeck
from pksampler.train.modeling.head_replicas import RangeCopy
from pksampler.train.modeling.range_checkpoint import load_part, read_rows, whole_copy
from pksampler.train.modeling.sharded_head import ShardedMarginHead

if TYPE_CHECKING:
    from pksampler.train.config.schema import RunConfig

__all__ = ["HeadedLoss", "saved_row_shape", "saved_rows", "whole_loss_state"]


def saved_row_shape(saved: dict[str, Any]) -> tuple[int, ...]:
    """The (classes, subcentres, dimension) of a checkpoint's head (its loss state, ``saved``), either layout."""
    head = saved["head"]
    if "ranges" in saved:
        return (int(head["num_classes"]), int(head["subcentres"]), int(head["dim"]))
    return tuple(head["rows"].shape)


def saved_rows(saved: dict[str, Any], ids: np.ndarray) -> torch.Tensor:
    """Rows ``ids`` (class ids) of a checkpoint's head, the one reader of them: from the range files that hold
    them (its manifest made absolute by :func:`~pksampler.train.modeling.range_checkpoint.located`), or from
    the whole head inside an older checkpoint."""
    if "ranges" in saved:
        return read_rows(saved["ranges"]["manifest"], ids)[0]
    return saved["head"]["rows"][torch.from_numpy(np.asarray(ids, dtype=np.int64))]


def whole_loss_state(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's loss state with the whole head inside (:meth:`HeadedLoss.state_dict`'s layout, which every
    version loads), its rows and momentum read from its range files; an older state as it is. Holds the whole
    table: for one process that wants it (an export, a test), never a training rank."""
    if "ranges" not in saved:
        return saved
    rows, momentum = whole_copy(saved["ranges"]["manifest"]).tensors
    dense = {key: value for key, value in saved.items() if key != "ranges"}
    return {**dense, "head": {**saved["head"], "rows": rows, "momentum": momentum, "momentum_of_own_loss": True}}


class HeadedLoss(torch.nn.Module):
    """``pair_weight · pair(embeddings, labels) + weight · head(embeddings, labels)``: the loss with a sharded head.

    A module of three parts, the pair loss, the head and the BNNeck (``neck``), so ``parameters``, ``to``,
    ``train`` and ``buffers`` are nn.Module's; a pair loss that is not a module
    (:class:`~pksampler.train.losses.pair.MetricLoss`) brings its trainable parameters as
    ``pair_parameters``. ``weight`` is the head's :attr:`~ShardedMarginHead.loss_weight`.

    ``state_dict`` and ``load_state_dict`` are nn.Module's too: this rank's state (the pair loss's, the neck's and
    the head's range, :meth:`ShardedMarginHead.get_extra_state`). What any world size loads is a checkpoint's
    layout, written as :meth:`whole_state` (the whole head keyed by class id, nested as every checkpoint before
    was written) or, by a training checkpoint, as :meth:`range_state`'s dense state with each rank's range in a
    file of its own (:meth:`Trainer.state_dict`, docs/sharded-head.md); :meth:`load_saved` reads either, and
    so does ``load_state_dict`` (a pre-hook hands such a state to it).
    """

    def __init__(self, pair: Any, head: ShardedMarginHead, *, neck: BNNeck | None = None,
                 pair_weight: float = 1.0) -> None:
        super().__init__()
        self.pair = pair
        if not isinstance(pair, torch.nn.Module) and hasattr(pair, "parameters"):
            self.pair_parameters = torch.nn.ParameterList(pair.parameters())
        self.head, self.neck = head, neck  # the head reads neck(embeddings), the pair loss the embeddings
        self.pair_weight = pair_weight  # 0: the head alone (the pair loss is not computed)
        self.last_head_loss = torch.zeros(())
        self.register_load_state_dict_pre_hook(_checkpoint_layout)

    @property
    def weight(self) -> float:
        """The head's loss weight in the network's gradient (``head.weight``)."""
        return self.head.loss_weight

    @classmethod
    def from_config(cls, config: "RunConfig", collectives: Any, pair: Any, *, num_classes: int,
                    world: World | None = None, gathered: bool = True, elastic: bool = False) -> "HeadedLoss":
        """The pair loss ``pair`` plus the head that ``head:`` configures, this rank's range of its C rows in
        ``world`` (None: the world the collectives carry, :meth:`World.of`: a backend's with its loss scale).

        ``gathered``: the trainer all-gathers the embeddings (needed by a head at more than one rank, and under
        Horovod elastic, whose world may grow).
        """
        head = config.head
        if (collectives.size > 1 or elastic) and not gathered:
            raise ConfigError("head.name: a sharded head needs train.gather_embeddings: true (every rank's rows see "
                              "the global batch)")
        world = world if world is not None else World.of(collectives)
        module = ShardedMarginHead(num_classes, config.model.embedding_dim, collectives, name=head.name,
                                   scale=head.scale, margin=head.margin, negatives=head.negatives,
                                   subcentres=head.subcentres, softmax_steps=head.softmax_steps,
                                   margin_ramp_steps=head.margin_ramp_steps, seed=config.seed, world=world,
                                   loss_weight=head.weight)
        neck = BNNeck(config.model.embedding_dim, grad_divisor=world.loss_scale) if head.bnneck else None
        return cls(pair, module, neck=neck, pair_weight=config.loss.weight)

    def step_scalars(self) -> dict[str, float]:
        """The head's numbers of the step just taken, for the step record: its loss (the margin's, the one
        trained), the same loss without the margin (comparable over the ramp and with ln C) and the margin."""
        loss, softmax_loss = torch.stack([self.last_head_loss, self.head.last_softmax_loss]).tolist()  # one copy
        return {"head_loss": loss, "head_softmax_loss": softmax_loss, "head_margin": self.head.last_margin}

    def head_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The head's loss of the gathered batch (through the neck when there is one)."""
        return self.head(self.neck(embeddings) if self.neck is not None else embeddings, labels)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head_loss = self.head_loss(embeddings, labels)
        self.last_head_loss = head_loss.detach()
        if self.pair_weight == 0:
            return self.weight * head_loss
        return self.pair_weight * self.pair(embeddings, labels) + self.weight * head_loss

    # --- the sharded-state protocol (docs/sharded-head.md): this loss owns the head's share of the world ---
    @property
    def num_rows(self) -> int:
        """Rows of the whole table: the head's C classes."""
        return self.head.num_classes

    def set_world(self, world: World) -> None:
        """The world protocol (a Horovod elastic reset): the head's range and gradient scale and the neck's
        divisor in ``world``; the rows are zero until loaded (:meth:`load_range`, or :meth:`load_initial` before
        any commit). Not collective: the trainer calls it on every survivor; a joiner's loss is built in its world."""
        self.head.set_world(world)
        if self.neck is not None:
            self.neck.set_world(world)

    def load_initial(self) -> None:
        """For a new world with no committed step: the initial rows of this rank's range."""
        self.head.load_initial()

    def range_state(self, *, copy: bool = True) -> tuple[dict[str, Any], RangeCopy]:
        """Horovod elastic's commit of this rank (no collective): the dense state (pair loss, neck, the head's
        step and decay log; the same on every rank) and a host copy of this rank's rows and momentum (with
        ``copy=False``, rows on the host already are the live ones: a checkpoint writes them at once)."""
        meta, own = self.head.range_state(copy=copy)
        dense = {"pair": self.pair.state_dict(), "head": meta}
        if self.neck is not None:
            dense["neck"] = self.neck.state_dict()
        return dense, own

    def load_range(self, dense: dict[str, Any], fill: Callable[..., None]) -> None:
        """For a new world: this rank's range of rows and momentum written by ``fill(rows, momentum)`` (a
        collective, :func:`~pksampler.train.modeling.head_replicas.assemble`), then ``dense``
        (:meth:`range_state`'s). The range is the current world's (:meth:`set_world`, or a joiner's head built
        in it)."""
        self.head.load_range(dense["head"], fill)
        self._load_pair_and_neck(dense)

    def saved_copy(self, saved: dict[str, Any]) -> tuple[dict[str, Any], RangeCopy]:
        """An older checkpoint's loss state (the whole head inside it, :meth:`whole_state`'s layout) as
        :meth:`range_state` gives a range: the dense state and one copy of every row, for rank 0 of a resumed
        Horovod elastic job, which read the checkpoint and holds that head already. A rank-range checkpoint's
        rows are never copied whole: every rank reads its own range's files."""
        self.head.check_whole(saved["head"])
        head = dict(saved["head"])
        rows, momentum = head.pop("rows"), head.pop("momentum")
        if not head.get("momentum_of_own_loss"):
            momentum = momentum / self.weight
        return {**saved, "head": head}, RangeCopy(0, rows.shape[0], (rows, momentum))

    # --- nn.Module's state: a pair loss that is not a module keeps its own state here ---------------------------
    def get_extra_state(self) -> dict[str, Any]:
        """The pair loss's state when it is not a module (a module's entries are nn.Module's own)."""
        return {} if isinstance(self.pair, torch.nn.Module) else {"pair": self.pair.state_dict()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        if "pair" in state:
            self.pair.load_state_dict(state["pair"])

    # --- the checkpoint: the whole head keyed by class id, or each rank's range in files; any W loads it ------
    def whole_state(self, *, everywhere: bool = False) -> dict[str, Any]:
        """The pair loss's state, the whole head keyed by class id and the neck's, nested (the layout every
        checkpoint before the range files was written in). A collective: every rank calls it together; the
        head's rows and momentum reach rank 0 only unless ``everywhere`` (:meth:`ShardedMarginHead.whole_state`)."""
        state = {"pair": self.pair.state_dict(), "head": self.head.whole_state(everywhere=everywhere)}
        if self.neck is not None:
            state["neck"] = self.neck.state_dict()
        return state

    def load_saved(self, saved: dict[str, Any]) -> None:
        """A checkpoint's loss state, this rank's range of the head: read from the files that overlap it (a
        rank-range checkpoint: :meth:`range_state`'s dense state and ``ranges``, its manifest made absolute by
        :func:`~pksampler.train.modeling.range_checkpoint.located`), or taken from the whole head inside an
        older checkpoint (:meth:`whole_state`'s layout)."""
        if "head" not in saved:
            raise ValueError("the checkpoint has no head (head.name was null when it was written)")
        if "ranges" in saved:
            self.head.check_saved(saved["head"])
            load_part(self, saved, self.head.lo, self.head.hi, key="loss")
            return
        self.head.load_whole(saved["head"])
        self._load_pair_and_neck(saved)

    def _load_pair_and_neck(self, saved: dict[str, Any]) -> None:
        """The dense parts of :meth:`whole_state`: the pair loss's state and the BNNeck's (which must match)."""
        self.pair.load_state_dict(saved["pair"])
        if (self.neck is not None) != ("neck" in saved):
            raise ValueError(f"the checkpoint's head {'has' if 'neck' in saved else 'has no'} BNNeck, this run's "
                             f"head.bnneck is {self.neck is not None}: they must match")
        if self.neck is not None:
            self.neck.load_state_dict(saved["neck"])


#: the top-level names of a checkpoint's loss state (:meth:`HeadedLoss.whole_state`, or the range files' layout)
_CHECKPOINT_NAMES = ("pair", "head", "neck", "ranges")


def _checkpoint_layout(module: HeadedLoss, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """nn.Module's ``load_state_dict`` pre-hook: a checkpoint's loss state (nested, the head whole or in range
    files) goes to :meth:`HeadedLoss.load_saved`, and the module's own entries of what it loaded stand in for
    it, so nn.Module's loading finds every key it expects. A state with no head at all is refused in one line."""
    if not isinstance(state_dict.get(prefix + "head"), dict):
        if prefix + "head._extra_state" not in state_dict:
            raise ValueError("the checkpoint has no head (head.name was null when it was written)")
        return
    module.load_saved({name: state_dict.pop(prefix + name) for name in _CHECKPOINT_NAMES
                       if prefix + name in state_dict})
    state_dict.update(module.state_dict(prefix=prefix))
