"""Rank, world size and the few collectives pksampler needs, written once.

Everything that asks "which rank am I" or talks to the other ranks goes
through this module (the role of detectron2's ``utils/comm.py``): the
samplers' auto-detection and consistency check, the triplet sampler's
neighbour-table broadcast and the trainer's backends.

Two things live here: the world (:func:`detect_world`, the one place that
asks a runtime or a launcher which rank this is) and the collectives: the
functions below, the :class:`Collectives` protocol that every part talking to
the other ranks is written against (the trainer's backends satisfy it, and
:class:`ProcessCollectives`, the default object over whichever runtime this
process started), and the differentiable collectives beside them
(:func:`all_gather` keeps gradients, :func:`sum_gradient` and
:func:`sum_over_ranks` for a loss computed over rows spread across ranks).

Runtimes, in the order they are looked for:

1. Horovod, if the program imported ``horovod.torch`` and called ``hvd.init()``;
2. torch.distributed, if a process group is initialised;
3. neither: one process (collectives are the identity), except that
   :func:`world_info` still reads a launcher's environment so a sampler built
   before the runtime starts gets the right rank (``RANK``/``WORLD_SIZE`` of
   torchrun and ``accelerate launch``, Horovod's and MPI's variables, and
   Lightning's ``WORLD_SIZE``/``NODE_RANK``/``LOCAL_RANK``).

This module never imports Horovod itself; it only uses one the program
started, so importing it (and the samplers) costs nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Protocol

import numpy as np
import torch

__all__ = [
    "Collectives",
    "LAUNCHER_ENVIRONMENT",
    "LOCAL_SIZE_ENVIRONMENT",
    "ProcessCollectives",
    "add_local_rank_argument",
    "adopt_local_rank",
    "all_gather",
    "all_gather_numpy",
    "allreduce_mean",
    "allreduce_sum",
    "alltoall",
    "barrier",
    "broadcast_object",
    "detect_world",
    "drop_padding",
    "initialised_horovod",
    "initialised_torch_distributed",
    "launcher",
    "launcher_local_size",
    "launcher_world",
    "local_rank",
    "pad_rows",
    "started_collectives",
    "sum_gradient",
    "sum_over_ranks",
    "world_info",
]

#: (rank, size, local rank) variables set by the launchers pksampler knows
LAUNCHER_ENVIRONMENT = (
    ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
)

#: ranks on this host, as torchrun, horovodrun, Open MPI and MPICH/Intel MPI name it
LOCAL_SIZE_ENVIRONMENT = ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


def initialised_horovod() -> Any | None:
    """``horovod.torch`` if the program imported and initialised it, else None."""
    hvd = sys.modules.get("horovod.torch")
    try:
        return hvd if hvd is not None and hvd.is_initialized() else None
    except (AttributeError, ValueError, RuntimeError):
        return None


def initialised_torch_distributed() -> Any | None:
    """``torch.distributed`` if a process group is initialised, else None."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except (AttributeError, RuntimeError, ValueError):
        return None


def launcher_world(environ: dict[str, str] | None = None) -> tuple[int, int, int] | None:
    """``(rank, size, local_rank)`` from a launcher's environment variables, or None.

    Raises ValueError naming the variables when they are set but not integers.
    """
    environ = os.environ if environ is None else environ
    for rank_key, size_key, local_key in LAUNCHER_ENVIRONMENT:
        rank, size = environ.get(rank_key), environ.get(size_key)
        if rank is None or size is None:
            continue
        local = environ.get(local_key, rank)
        try:
            return int(rank), int(size), int(local)
        except ValueError:
            raise ValueError(
                f"environment variables {rank_key}={rank!r}, {size_key}={size!r} and {local_key}={local!r} "
                "must be integers"
            ) from None
    return _lightning_world(environ)


def _lightning_world(environ: Any) -> tuple[int, int, int] | None:
    """``(rank, size, local_rank)`` from what Lightning's launcher gives its processes, or None.

    Lightning's ddp children carry ``WORLD_SIZE``, ``LOCAL_RANK`` and
    ``NODE_RANK`` but no ``RANK`` until its process group starts. On node 0
    the rank is the local rank; on another node it needs ``LOCAL_WORLD_SIZE``
    (processes per node), else the rank cannot be known and this raises,
    naming the fix, rather than guess.
    """
    size, local, node = environ.get("WORLD_SIZE"), environ.get("LOCAL_RANK"), environ.get("NODE_RANK", "0")
    if size is None or local is None:
        return None
    try:
        size_, local_, node_ = int(size), int(local), int(node)
        per_node = int(environ.get("LOCAL_WORLD_SIZE", 0))
    except ValueError:
        raise ValueError(f"environment variables WORLD_SIZE={size!r}, LOCAL_RANK={local!r} and NODE_RANK={node!r} "
                         "must be integers") from None
    if node_ and not per_node:
        raise ValueError(
            f"the environment has WORLD_SIZE={size_}, NODE_RANK={node_} and LOCAL_RANK={local_} but no RANK or "
            "LOCAL_WORLD_SIZE, so this process's rank cannot be known before the process group starts: build the "
            "sampler after it starts (e.g. in LightningDataModule.setup()) or pass num_replicas= and rank="
        )
    return node_ * per_node + local_, size_, local_


def launcher(environ: dict[str, str] | None = None) -> str | None:
    """Which launcher started this process, from its environment: ``horovodrun``, ``torchrun`` or None.

    The one launcher detector: the trainer's ``distributed.backend: auto``
    and the samplers' world detection both read it (or :func:`launcher_world`).
    """
    environ = os.environ if environ is None else environ
    if "HOROVOD_RANK" in environ or "HOROVOD_HOSTNAME" in environ:
        return "horovodrun"
    if "TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "MASTER_ADDR" in environ):
        return "torchrun"
    return None


def launcher_local_size(environ: Any = None) -> int:
    """Ranks on this host from the launcher's environment (:data:`LOCAL_SIZE_ENVIRONMENT`); 1 when none says."""
    environ = os.environ if environ is None else environ
    for key in LOCAL_SIZE_ENVIRONMENT:
        if environ.get(key, "").isdigit():
            return max(1, int(environ[key]))
    return 1


def detect_world() -> tuple[int, int, int, int, str] | None:
    """``(rank, size, local_rank, local_size, source)`` of this process, or None when nothing says.

    The one detection cascade (:meth:`pksampler.world.World.detect` wraps it in
    a value): Horovod (``source="Horovod"``), torch.distributed
    (``"torch.distributed"``), the launcher's environment (``"the launcher's
    environment"``). The local rank and the ranks per host come from Horovod
    when it runs, else from the launcher.
    """
    hvd = initialised_horovod()
    if hvd is not None:  # the launcher's environment is not read: Horovod knows all four
        return int(hvd.rank()), int(hvd.size()), int(hvd.local_rank()), int(hvd.local_size()), "Horovod"
    dist = initialised_torch_distributed()
    if dist is not None:  # the rank is the process group's; only the host's share comes from the environment
        return (int(dist.get_rank()), int(dist.get_world_size()), _environment_local_rank(), launcher_local_size(),
                "torch.distributed")
    found = launcher_world()
    if found is None:
        return None
    return found[0], found[1], found[2], launcher_local_size(), "the launcher's environment"


def _environment_local_rank() -> int:
    """The first integer local rank a launcher set (:data:`LAUNCHER_ENVIRONMENT`'s order), else 0; never raises:
    under a running process group the rank does not depend on it."""
    for _, _, key in LAUNCHER_ENVIRONMENT:
        value = _as_int(os.environ.get(key, ""))
        if value is not None and value >= 0:
            return value
    return 0


def world_info() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: Horovod, torch.distributed, the launcher's environment, else (0, 1)."""
    found = detect_world()
    return (found[0], found[1]) if found is not None else (0, 1)


def local_rank() -> int:
    """This process's rank on its node (selects its GPU)."""
    found = detect_world()
    return found[2] if found is not None else 0


def add_local_rank_argument(parser: Any) -> None:
    """Accept ``--local-rank=N`` and ``--local_rank N`` on an ``argparse`` parser.

    ``python -m torch.distributed.launch`` passes one of them to every process
    it starts (its guide: a script must accept it even if unused). Pass the
    parsed value to :func:`adopt_local_rank`. Given twice with two values
    (the launcher's and one copied from an old command line), it is a usage
    error rather than the last one silently winning.
    """
    parser.add_argument("--local-rank", "--local_rank", dest="local_rank", type=int, default=None, metavar="N",
                        action=_OneLocalRank,
                        help="this process's rank on its node, as python -m torch.distributed.launch passes it "
                             "(must agree with LOCAL_RANK; selects the GPU as LOCAL_RANK does)")


class _OneLocalRank(argparse.Action):
    """``--local-rank``: stored once; a second, different value is a usage error naming both."""

    def __call__(self, parser: Any, namespace: Any, value: Any, option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        if before is not None and before != value:
            parser.error(f"{option_string}={value}: --local-rank was already given as {before}; a process has one "
                         "local rank, so give it once")
        setattr(namespace, self.dest, value)


def adopt_local_rank(value: int | None, environ: Any = None) -> None:
    """Make the launcher's ``--local-rank`` argument and the launcher's local rank one value.

    Every local-rank variable a launcher set (``LOCAL_RANK``, ``HOROVOD_LOCAL_RANK``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``) must equal it, as an
    integer: under horovodrun the device comes from Horovod's, so a different
    argument would be silently ignored. ``LOCAL_RANK`` is set from the argument
    when missing, so the device is picked from it. A disagreement is a ValueError
    naming both."""
    environ = os.environ if environ is None else environ
    if value is None:
        return
    if value < 0:
        raise ValueError(f"--local-rank={value}: must be an integer >= 0 (this process's rank on its node)")
    for _, _, key in LAUNCHER_ENVIRONMENT:
        given = environ.get(key)
        if given is not None and _as_int(given) != value:
            raise ValueError(f"--local-rank={value} disagrees with the environment variable {key}={given!r}: the "
                             "launcher gives every process one local rank; pass one of them, or the same value")
    environ.setdefault("LOCAL_RANK", str(value))


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def all_gather(tensor: torch.Tensor, *, name: str | None = None, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0, in rank order, keeping gradients.

    The first dimension may differ between ranks (a global step whose G
    classes do not split evenly over the ranks); the other dimensions must
    agree. Horovod's allgather takes unequal first dims natively. torch's
    all_gather needs equal shapes, so each rank pads to the longest and the
    padding rows are dropped after the gather; ``sizes`` (every rank's first
    dim, in rank order) saves the small collective that otherwise finds them.

    In backward, Horovod averages the incoming gradients and torch sums them
    (see :class:`pksampler.train.runtime.distributed.Backend.gathered_loss_scale`);
    each rank receives the rows of its own part, whatever the sizes.
    """
    hvd = initialised_horovod()
    if hvd is not None:
        return hvd.allgather(tensor, name=name)
    dist = initialised_torch_distributed()
    if dist is None:
        return tensor
    sizes = _first_dims(dist, tensor) if sizes is None else [int(n) for n in sizes]
    if len(sizes) != dist.get_world_size() or sizes[dist.get_rank()] != tensor.shape[0]:
        raise ValueError(f"all_gather(sizes=) must list every rank's first dimension ({dist.get_world_size()} "
                         f"values, this rank's = {tensor.shape[0]}), got {sizes}")
    padded = pad_rows(tensor.contiguous(), max(sizes))
    if tensor.requires_grad:
        from torch.distributed import _functional_collectives as functional

        # all_gather_single_autograd in newer torch (2.13 here), where the older name all_gather_tensor_autograd warns
        gather = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd
        gathered = gather(padded, 0, dist.group.WORLD)
        gathered = functional.wait_tensor(gathered) if hasattr(functional, "wait_tensor") else gathered
    else:
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded)
        gathered = torch.cat(parts, dim=0)
    return drop_padding(gathered, sizes)


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with zero rows appended up to ``rows`` (differentiable; the padding gets no gradient)."""
    if tensor.shape[0] >= rows:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def drop_padding(gathered: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The real rows of an all-gather of tensors padded to ``max(sizes)`` rows: rank r's first ``sizes[r]``."""
    longest = max(sizes)
    if min(sizes) == longest:
        return gathered
    rows = torch.cat([torch.arange(n) + rank * longest for rank, n in enumerate(sizes)]).to(gathered.device)
    return gathered.index_select(0, rows)


def _first_dims(dist: Any, tensor: torch.Tensor) -> list[int]:
    """Every rank's ``tensor.shape[0]``, in rank order (one small all_gather)."""
    mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    return [int(part.item()) for part in parts]


def all_gather_numpy(row: np.ndarray, *, device: torch.device | str | None = None) -> np.ndarray:
    """Every rank's 1-D int64 ``row`` as a ``(W, F)`` array (fingerprints, small tables).

    ``device``: where the collective runs (NCCL needs the rank's GPU); the
    result always comes back to host memory.
    """
    tensor = torch.from_numpy(np.ascontiguousarray(row, dtype=np.int64))[None]
    if device is not None:
        tensor = tensor.to(device)
    return all_gather(tensor, name="pksampler.all_gather_numpy").cpu().numpy()


def allreduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of ``tensor`` over ranks (no gradient)."""
    hvd = initialised_horovod()
    if hvd is not None:
        return hvd.allreduce(tensor.detach(), op=hvd.Average)
    dist = initialised_torch_distributed()
    if dist is None:
        return tensor.detach()
    out = tensor.detach().clone()
    dist.all_reduce(out)
    return out / dist.get_world_size()


def allreduce_sum(tensor: torch.Tensor, *, name: str | None = None) -> torch.Tensor:
    """The sum of ``tensor`` over ranks (no gradient; float64 stays float64 on every runtime)."""
    hvd = initialised_horovod()
    if hvd is not None:
        return hvd.allreduce(tensor.detach(), op=hvd.Sum, name=name)
    dist = initialised_torch_distributed()
    if dist is None:
        return tensor.detach()
    out = tensor.detach().clone()
    dist.all_reduce(out)
    return out


def alltoall(tensor: torch.Tensor, splits: list[int], *, name: str | None = None) -> torch.Tensor:
    """Rank r sends ``tensor[sum(splits[:q]):sum(splits[:q + 1])]`` to rank q; returns what it received, in rank order.

    The first dimension may differ between ranks (0 included); the others must
    agree. No gradient. One process: ``splits`` must be ``[len(tensor)]``.
    """
    if sum(splits) != tensor.shape[0]:
        raise ValueError(f"alltoall(splits=): the splits must add up to the tensor's first dimension "
                         f"({tensor.shape[0]}), got {list(splits)}")
    hvd = initialised_horovod()
    if hvd is not None:
        received, _ = hvd.alltoall(tensor.detach(), splits=torch.tensor(splits, dtype=torch.int32), name=name)
        return received
    dist = initialised_torch_distributed()
    if dist is None:
        return tensor.detach()
    sent = torch.tensor(splits, dtype=torch.int64, device=tensor.device)
    counts = torch.empty_like(sent)
    dist.all_to_all_single(counts, sent)
    out = tensor.new_empty((int(counts.sum()), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.detach().contiguous(), [int(n) for n in counts.tolist()], list(splits))
    return out


def broadcast_object(value: Any, root: int = 0, *, name: str = "pksampler.broadcast_object") -> Any:
    """``value`` of rank ``root`` on every rank (any picklable object; sent, never read from disk).

    ``name`` must be the same on every rank: Horovod's default name is the
    value's type name, which differs between the sender (a value) and the
    receivers (None) and would deadlock.
    """
    hvd = initialised_horovod()
    if hvd is not None:
        return hvd.broadcast_object(value, root_rank=root, name=name)
    dist = initialised_torch_distributed()
    if dist is None:
        return value
    holder = [value]
    device = None
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    dist.broadcast_object_list(holder, src=root, device=device)
    return holder[0]


def barrier() -> None:
    """Wait until every rank arrives."""
    hvd = initialised_horovod()
    if hvd is not None:
        hvd.allreduce(torch.zeros(1), name="pksampler.barrier")
        return
    dist = initialised_torch_distributed()
    if dist is not None:
        dist.barrier()


class Collectives(Protocol):
    """What a part that talks to the other ranks is written against: the world and the collectives.

    The trainer's backends (:mod:`pksampler.train.runtime.distributed`) satisfy
    it, and so does :class:`ProcessCollectives` (whichever runtime this process
    started; one process: the identity). Tests pass a group of fakes that loop
    over ranks in one process.
    """

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allgather(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor: ...

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray: ...

    def alltoall(self, tensor: torch.Tensor, splits: list[int]) -> torch.Tensor: ...

    def broadcast_object(self, value: Any, root: int = 0, *, name: str = "pksampler.broadcast_object") -> Any: ...

    def barrier(self) -> None: ...


class ProcessCollectives:
    """:class:`Collectives` over whichever runtime this process started (the module's functions).

    The rank and size are read live (:func:`world_info`); a subclass that keeps
    its own world (the trainer's backends, whose world changes only through
    ``set_world``) overrides them.
    """

    @property
    def rank(self) -> int:
        return world_info()[0]

    @property
    def size(self) -> int:
        return world_info()[1]

    @property
    def collective_device(self) -> torch.device | None:
        """Where small tensor collectives must live (NCCL: the rank's GPU); None: the host."""
        return None

    def allgather(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` along dim 0, in rank order, keeping gradients (:func:`all_gather`)."""
        return all_gather(tensor, sizes=sizes)

    def allreduce_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return allreduce_mean(tensor)

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return allreduce_sum(tensor)

    def allgather_numpy(self, row: np.ndarray) -> np.ndarray:
        """``(F,)`` int64 row of every rank as a ``(W, F)`` array (fingerprints, small tables)."""
        return all_gather_numpy(row, device=self.collective_device)

    def alltoall(self, tensor: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """Send ``splits[q]`` rows of ``tensor`` to rank q (in rank order); the rows received, in rank order."""
        return alltoall(tensor, splits)

    def broadcast_object(self, value: Any, root: int = 0, *, name: str = "pksampler.broadcast_object") -> Any:
        return broadcast_object(value, root, name=name)

    def barrier(self) -> None:
        barrier()


def started_collectives(owner: str) -> ProcessCollectives:
    """:class:`ProcessCollectives`, refusing (RuntimeError naming ``owner``) a launch of several ranks whose runtime
    this process has not started: its collectives would be the identity and each rank would see only its own part."""
    size = world_info()[1]
    if size > 1 and initialised_horovod() is None and initialised_torch_distributed() is None:
        raise RuntimeError(f"{owner}: the launcher started {size} ranks but neither Horovod nor torch.distributed is "
                           "initialised here; call hvd.init() or torch.distributed.init_process_group() first (or "
                           "pass collectives=)")
    return ProcessCollectives()


class _SumGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ranks (each rank's rows give a part of it)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, collectives: Collectives) -> torch.Tensor:  # type: ignore[override]
        ctx.collectives = collectives
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return ctx.collectives.allreduce_sum(grad.contiguous()), None


class _SumOverRanks(torch.autograd.Function):
    """Sum over ranks forward; backward passes the gradient through (every rank holds the same loss)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, collectives: Collectives) -> torch.Tensor:  # type: ignore[override]
        return collectives.allreduce_sum(tensor.contiguous())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def sum_gradient(tensor: torch.Tensor, collectives: Collectives) -> torch.Tensor:
    """``tensor`` unchanged; in backward its gradient is summed over the ranks.

    For an input that every rank holds whole (the gathered embeddings) and
    that each rank uses against its own rows: each rank's gradient is a part.
    """
    return _SumGradient.apply(tensor, collectives)


def sum_over_ranks(tensor: torch.Tensor, collectives: Collectives) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks; in backward the gradient passes through unchanged.

    For partial sums (a softmax's denominator over rows spread across ranks)
    after which every rank holds the same loss.
    """
    return _SumOverRanks.apply(tensor, collectives)
