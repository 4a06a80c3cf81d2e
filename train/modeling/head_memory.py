"""How much memory a row-sharded head needs on a host, and one clear line when the host lacks it.

Planned once, by the application, with what the run mode knows: how many ranks share the host, whether Horovod
elastic keeps committed copies, and whether every rank builds its head at the same time (then the ranks agree in
one collective, so a host short of memory stops every rank with the same line). The head itself plans nothing.
"""

from __future__ import annotations

from pksampler.agree import gather_outcomes
from pksampler.comm import Collectives
from pksampler.train.errors import ConfigError

__all__ = ["GATHER_BLOCK_BYTES", "available_host_bytes", "check_head_memory", "head_memory"]

#: bytes one collective of a whole head's gather brings to each rank (``HeadedLoss.state_dict``, outside training)
GATHER_BLOCK_BYTES = 64 << 20


def head_memory(num_classes: int, dim: int, subcentres: int, world: int) -> dict[str, int]:
    """Bytes one rank holds for the head: its rows and their momentum (fp32, ⌈C/W⌉·k·D each), the row clock
    (8 bytes a row) and, at a checkpoint, a host copy of its range's rows and momentum, which it writes itself
    (``checkpoint``, :mod:`~pksampler.train.modeling.range_checkpoint`: no rank holds the whole head). Under
    Horovod elastic each rank also keeps its committed range and one replica, rows and momentum, and holds the
    previous commit's until a new one is complete (``elastic_commit``: 8 shares at that peak)."""
    share = -(-num_classes // max(world, 1)) * subcentres * dim * 4
    return {"rows": share, "momentum": share, "clock": -(-num_classes // max(world, 1)) * 8,
            "checkpoint": 2 * share, "elastic_commit": 8 * share}


def available_host_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, capped by a cgroup limit (v2 or v1); None if unknown."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for path, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(path, encoding="ascii") as limit, open(usage, encoding="ascii") as used:
                text = limit.read().strip()
                if text != "max" and int(text) < 1 << 60:
                    found.append(int(text) - int(used.read().strip()))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def check_head_memory(num_classes: int, dim: int, subcentres: int, *, world: int, local_ranks: int = 1,
                      available: int | None = None, elastic: bool = False,
                      collectives: Collectives | None = None) -> None:
    """Refuse, in one line naming ``head.*`` and C, a head that the host's memory cannot hold.

    The host holds ``local_ranks`` ranks' rows and momentum and, at a checkpoint, each one's copy of its range;
    under Horovod elastic
    (``elastic``) every rank's committed copies too; ``available`` defaults to :func:`available_host_bytes`
    (skipped when unknown). With ``collectives``, the ranks exchange their need and their host's free memory
    first, so every rank raises the same error naming the worst rank (one host short of memory would otherwise
    stop only its own ranks, and the others would fail later in a collective).
    """
    available = available_host_bytes() if available is None else available
    need = head_memory(num_classes, dim, subcentres, world)
    steady = need["rows"] + need["momentum"] + need["clock"] + (need["elastic_commit"] if elastic else 0)
    total = local_ranks * (steady + need["checkpoint"])
    where = "on this host"
    if collectives is not None and collectives.size > 1:
        rows = gather_outcomes(collectives, None, [total, -1 if available is None else available]).values
        short = [(int(a) - int(t), rank) for rank, (t, a) in enumerate(rows) if a >= 0 and t > a]
        if not short:
            return
        rank = min(short)[1]  # the rank whose host lacks the most
        total, available = int(rows[rank, 0]), int(rows[rank, 1])
        where = f"on rank {rank}'s host"
    if available is None:
        return
    if total > available:
        gib, copies = 1 << 30, " and Horovod elastic's committed copies" if elastic else ""
        raise ConfigError(
            f"head.name: a sharded head of C={num_classes:,} classes × head.subcentres={subcentres} × "
            f"model.embedding_dim={dim} needs about {total / gib:.2f} GiB {where} ({local_ranks} rank(s) × "
            f"{steady / gib:.2f} GiB of rows and momentum{copies} at W={world}, plus "
            f"{local_ranks * need['checkpoint'] / gib:.2f} GiB for the checkpoint's copies of their ranges), but {available / gib:.2f} GiB are "
            "available: use fewer classes, a "
            "smaller model.embedding_dim or head.subcentres, or hosts with more memory")
