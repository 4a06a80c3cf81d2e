"""A process-group store of each torchrun launch's own, so a restarted rank never reads the last launch's keys.

Why: torchrun's agent shares its rendezvous ``TCPStore`` with the workers
(unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: then rank 0's ``env://``
store is fresh per launch and is used as it is), and ``init_process_group``
writes its gloo addresses (or NCCL's unique id) there under fixed keys. After
a restart (a lost node, a failed rank) those keys still hold the previous
launch's values, so a rank that arrives first can read its peer's stale
address: "connection refused" costs a restart, and with two stale ports both
ranks can wait to be connected to, for up to the process group's timeout.

How, whatever the launcher's environment:

1. rank 0 starts a ``TCPStore`` server of its own on a free port of its host
   (the agent's ``MASTER_ADDR``: rank 0 runs on node rank 0, where the
   agent's store lives), writes a random launch id into it and then publishes
   ``"<port> <launch id>"`` in the agent's store under one key;
2. every other rank reads that key, which may still name the previous
   launch's store: it retries (a plain socket probe first, so a dead port is
   quiet) until a store answers at the published port *and* holds the
   published launch id;
3. the process group is built on that store, under a prefix; the wait is
   bounded (``connect_seconds``), so a stall ends the rank and the agent
   restarts the launch instead of waiting for the whole collective timeout.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import uuid
from typing import Any

__all__ = ["launch_store"]

_PUBLISHED = "pksampler/launch-store"
_LAUNCH_ID = "pksampler/launch-id"
_PROBE_SECONDS = 5.0
#: the agent's store is up before the workers start: a longer silence means there is none
_AGENT_CONNECT_SECONDS = 30.0


def launch_store(rank: int, *, connect_seconds: float) -> Any | None:
    """The store for this launch's process group (a ``PrefixStore``), or None outside torchrun.

    Raises:
        TimeoutError: no store of this launch answered within ``connect_seconds`` (the rank exits; the agent
            restarts the launch).
    """
    import torch.distributed as dist

    if "TORCHELASTIC_RUN_ID" not in os.environ or not os.environ.get("MASTER_ADDR") or not _agent_serves_store():
        return None  # no agent store at MASTER_PORT: env:// makes rank 0 host a fresh one per launch (no stale keys)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    deadline = time.monotonic() + connect_seconds
    timeout = datetime.timedelta(seconds=connect_seconds)
    agent = _agent_client(dist, host, port, min(connect_seconds, _AGENT_CONNECT_SECONDS))
    if rank == 0:
        own = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        launch_id = uuid.uuid4().hex
        own.set(_LAUNCH_ID, launch_id)
        agent.set(_PUBLISHED, f"{own.port} {launch_id}")
        return dist.PrefixStore("pksampler/process-group", own)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"rank {rank}: rank 0 of this launch published no process-group store at "
                               f"{host} within {connect_seconds:g} s; the launch ends and torchrun restarts it")
        agent.wait([_PUBLISHED], datetime.timedelta(seconds=remaining))
        published_port, launch_id = agent.get(_PUBLISHED).decode().split()
        own = _connect(dist, host, int(published_port), launch_id, remaining)
        if own is not None:
            return dist.PrefixStore("pksampler/process-group", own)
        time.sleep(0.1)  # the key still names the previous launch's store: read it again


def _agent_serves_store() -> bool:
    """Whether the torchrun agent serves its rendezvous store at ``MASTER_PORT``, by torch's own rule.

    The agent tells its workers in ``TORCHELASTIC_USE_AGENT_STORE`` (``"True"``; what ``env://`` reads too);
    without it, sharing is on unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` is ``"1"`` (the one value torch's
    rendezvous treats as set).
    """
    told = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    if told is not None:
        return told == str(True)
    return os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"


def _agent_client(dist: Any, host: str, port: int, seconds: float) -> Any:
    """A client of the agent's store, its first connect bounded by ``seconds``; one line when nothing answers.

    The agent's store is up before any worker starts, so a quiet port means there is none (a launcher set-up
    this module does not know): a plain socket probe first keeps the failure to one line, not store retries.
    """
    problem = None
    try:
        with socket.create_connection((host, port), timeout=seconds):
            pass
    except OSError as error:
        problem = f"{type(error).__name__}: {error}"
    if problem is None:
        try:
            return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=seconds))
        except RuntimeError as error:  # DistNetworkError and its kind
            problem = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise TimeoutError(f"torchrun's rendezvous store at MASTER_ADDR:MASTER_PORT = {host}:{port} did not answer "
                       f"within {seconds:g} s ({problem}); TORCHELASTIC_USE_AGENT_STORE="
                       f"{os.environ.get('TORCHELASTIC_USE_AGENT_STORE')!r}, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="
                       f"{os.environ.get('TORCH_DISABLE_SHARE_RDZV_TCP_STORE')!r}")


def _connect(dist: Any, host: str, port: int, launch_id: str, remaining: float) -> Any | None:
    """A client of the store at ``host:port`` if it answers and holds ``launch_id``; else None."""
    try:
        with socket.create_connection((host, port), timeout=min(_PROBE_SECONDS, remaining)):
            pass  # something listens: worth a store client (whose failed connects are loud)
    except OSError:
        return None
    try:
        own = dist.TCPStore(host, port, is_master=False,
                            timeout=datetime.timedelta(seconds=min(_PROBE_SECONDS, remaining)))
        own.wait([_LAUNCH_ID], datetime.timedelta(seconds=min(_PROBE_SECONDS, remaining)))
        return own if own.get(_LAUNCH_ID).decode() == launch_id else None
    except RuntimeError:  # DistError and its kind: not this launch's store
        return None
