"""The pair loss with a row-sharded margin head beside it (``head:``), built from the config in one call.

:meth:`HeadedLoss.from_config` is the whole head recipe (``head.*``; see
docs/sharded-head.md): a :class:`~pksampler.train.modeling.sharded_head.ShardedMarginHead`
with small rows and a scale derived from the number of classes, its own
row-sparse SGD (``head.lr`` for ``optim.base_batch`` images, linear in the
global batch, ``head.momentum``, ``head.weight_decay``; the rows step on the
head's own loss, ``head.weight`` divided out), the optional BNNeck and the
weights of the two losses in the network's gradient. The row optimizer's class is given by the
caller (the solver sits above the losses in the layering).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from pksampler.world import World

from pksampler.train.errors import ConfigError
from pksampler.train.modeling.bnneck import BNNeck
from pksampler.train.modeling.sharded_head import ShardedMarginHead

if TYPE_CHECKING:
    from pksampler.train.config.schema import RunConfig

__all__ = ["HeadedLoss"]


class HeadedLoss:
    """``pair_weight · pair(embeddings, labels) + weight · head(embeddings, labels)``: the loss with a sharded head.

    Behaves like the pair loss it wraps (``parameters``, ``to``, ``state_dict``);
    its state adds the head's rows and momentum, keyed by class id, so a
    checkpoint loads at any world size. :attr:`row_optimizer` is stepped by the
    trainer after the dense optimizer (:meth:`Trainer.optimizer_step`).
    """

    def __init__(self, pair: Any, head: ShardedMarginHead, row_optimizer: Any, *, weight: float,
                 neck: torch.nn.Module | None = None, pair_weight: float = 1.0) -> None:
        self.pair, self.head, self.row_optimizer, self.weight = pair, head, row_optimizer, weight
        self.pair_weight = pair_weight  # 0: the head alone (the pair loss is not computed)
        self.neck = neck  # BNNeck: the head reads neck(embeddings), the pair loss the embeddings
        self.last_head_loss = torch.zeros(())

    @classmethod
    def from_config(cls, config: "RunConfig", collectives: Any, pair: Any, *, num_classes: int, global_batch: int,
                    row_optimizer: Callable[..., Any], grad_divisor: float = 1.0, gathered: bool = True,
                    local_ranks: int = 1, elastic: bool = False) -> "HeadedLoss":
        """The pair loss ``pair`` plus the head that ``head:`` configures, this rank's range of its C rows.

        ``row_optimizer``: the rows' optimizer class (:class:`~pksampler.train.solver.sparse_rows.SparseRowSGD`),
        built with ``head.lr`` · global batch / ``optim.base_batch``, ``head.momentum``, ``head.weight_decay``.
        ``gathered``: the trainer all-gathers the embeddings (needed by a head at more than one rank, and under
        Horovod elastic, whose world may grow).
        """
        head = config.head
        if (collectives.size > 1 or elastic) and not gathered:
            raise ConfigError("head.name: a sharded head needs train.gather_embeddings: true (every rank's rows see "
                              "the global batch)")
        module = ShardedMarginHead(num_classes, config.model.embedding_dim, collectives, name=head.name,
                                   scale=head.scale, margin=head.margin, negatives=head.negatives,
                                   subcentres=head.subcentres, softmax_steps=head.softmax_steps,
                                   margin_ramp_steps=head.margin_ramp_steps, seed=config.seed,
                                   local_ranks=local_ranks, elastic=elastic, agree_memory=not elastic)
        rows = row_optimizer(module, lr=head.lr * global_batch / config.optim.base_batch, momentum=head.momentum,
                             weight_decay=head.weight_decay, grad_divisor=grad_divisor, loss_weight=head.weight)
        neck = BNNeck(config.model.embedding_dim, grad_divisor=grad_divisor) if head.bnneck else None
        return cls(pair, module, rows, weight=head.weight, neck=neck, pair_weight=config.loss.weight)

    def step_scalars(self) -> dict[str, float]:
        """The head's numbers of the step just taken, for the step record: its loss (the margin's, the one
        trained), the same loss without the margin (comparable over the ramp and with ln C) and the margin."""
        loss, softmax_loss = torch.stack([self.last_head_loss, self.head.last_softmax_loss]).tolist()  # one copy
        return {"head_loss": loss, "head_softmax_loss": softmax_loss, "head_margin": self.head.last_margin}

    def head_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The head's loss of the gathered batch (through the neck when there is one)."""
        return self.head(self.neck(embeddings) if self.neck is not None else embeddings, labels)

    def __call__(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head_loss = self.head_loss(embeddings, labels)
        self.last_head_loss = head_loss.detach()
        if self.pair_weight == 0:
            return self.weight * head_loss
        return self.pair_weight * self.pair(embeddings, labels) + self.weight * head_loss

    def set_world(self, world: World) -> None:
        """The world protocol (a Horovod elastic reset): this rank's range of rows in ``world``, zero until the
        committed head is assembled into it (:meth:`load_assembled`, or :meth:`load_initial` before any
        commit). Not collective: the trainer calls it on every survivor; a joiner's head is built in its world."""
        self.row_optimizer.begin_world(world)

    def _set_grad_divisor(self, grad_divisor: float) -> None:
        self.row_optimizer.grad_divisor = grad_divisor
        if self.neck is not None:
            self.neck.grad_divisor = grad_divisor

    def load_initial(self, *, grad_divisor: float) -> None:
        """For a new world with no committed step: the initial rows of this rank's range, the new divisor."""
        self._set_grad_divisor(grad_divisor)
        self.row_optimizer.load_initial()

    def own_range(self) -> tuple[dict[str, Any], Any]:
        """Horovod elastic's commit of this rank (no collective): the dense state (pair loss, neck, the head's
        step and decay log; the same on every rank) and a host copy of this rank's rows and momentum."""
        meta, own = self.row_optimizer.own_range()
        dense = {"pair": self.pair.state_dict(), "head": meta}
        if self.neck is not None:
            dense["neck"] = self.neck.state_dict()
        return dense, own

    def load_assembled(self, dense: dict[str, Any], fill: Callable[[torch.Tensor, torch.Tensor], None], *,
                       grad_divisor: float) -> None:
        """For a new world: this rank's new range, its rows and momentum written by ``fill(rows, momentum)``
        (a collective, :func:`~pksampler.train.modeling.head_replicas.assemble`), then ``dense``
        (:meth:`own_range`'s) and the new world's gradient divisor. The range is the current world's
        (:meth:`set_world`, or a joiner's head built in it)."""
        self._set_grad_divisor(grad_divisor)
        fill(self.head.rows, self.row_optimizer.buffer)
        self.row_optimizer.load_meta(dense["head"])
        self._load_pair_and_neck(dense)

    def parameters(self) -> list[torch.nn.Parameter]:
        neck = [p for p in self.neck.parameters() if p.requires_grad] if self.neck is not None else []
        return list(self.pair.parameters()) + neck

    def to(self, device: torch.device | str) -> "HeadedLoss":
        self.pair.to(device)
        self.head.to(device)
        if self.neck is not None:
            self.neck.to(device)
        self.row_optimizer.buffer = self.row_optimizer.buffer.to(device)
        return self

    def state_dict(self, *, everywhere: bool = False) -> dict[str, Any]:
        """The pair loss's state and the whole head (a collective: every rank calls it together; the head's rows
        and momentum reach rank 0 only unless ``everywhere``, see :meth:`SparseRowSGD.state_dict`)."""
        state = {"pair": self.pair.state_dict(), "head": self.row_optimizer.state_dict(everywhere=everywhere)}
        if self.neck is not None:
            state["neck"] = self.neck.state_dict()
        return state

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if "head" not in saved:
            raise ValueError("the checkpoint has no head (head.name was null when it was written)")
        self.row_optimizer.load_state_dict(saved["head"])
        self._load_pair_and_neck(saved)

    def _load_pair_and_neck(self, saved: dict[str, Any]) -> None:
        """The dense parts of :meth:`state_dict`: the pair loss's state and the BNNeck's (which must match)."""
        self.pair.load_state_dict(saved["pair"])
        if (self.neck is not None) != ("neck" in saved):
            raise ValueError(f"the checkpoint's head {'has' if 'neck' in saved else 'has no'} BNNeck, this run's "
                             f"head.bnneck is {self.neck is not None}: they must match")
        if self.neck is not None:
            self.neck.load_state_dict(saved["neck"])
