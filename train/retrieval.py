"""Train a retrieval embedding with P x K batches on every rank.

Usage::

    horovodrun -np 16 python train/retrieval.py [--config configs/products.yaml] [--set key=value ...]
    torchrun --nproc_per_node 2 train/retrieval.py
    python -m torch.distributed.launch --nproc_per_node 2 train/retrieval.py   # passes --local-rank=N
    python train/retrieval.py                      # one process, the synthetic default

With no arguments it trains on the built-in synthetic product set
(configs/demo.yaml). Environment variables of the training platform override
the file: DATASETS_PATH, DATASETS (several names, comma-separated: their
union), WORKSPACE, EPOCHS, LR, BATCH_SIZE, WORKER_PER_NODE; ``--set``
overrides both. BACKEND picks torch.distributed's backend (gloo, nccl, mpi).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterable, NoReturn

HERE = Path(__file__).resolve().parent
# Run as a script, Python puts train/ first on sys.path; drop it so module
# names in this folder cannot shadow installed packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

DEFAULT_CONFIG = HERE.parent / "configs" / "demo.yaml"
#: how long ranks other than 0 wait for rank 0 to report a config error before exiting themselves
_PEER_WAIT_SECONDS = 30.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from pksampler.comm import add_local_rank_argument

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None,
                        help=f"YAML run config (default: {DEFAULT_CONFIG.relative_to(HERE.parent)})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.epochs=3 (repeatable)")
    parser.add_argument("--resume", dest="resume", action="store_true", default=None,
                        help="continue from WORKSPACE/checkpoints/last.pt (the default when it exists)")
    parser.add_argument("--no-resume", dest="resume", action="store_false", help="start afresh")
    add_local_rank_argument(parser)
    return parser.parse_args(argv)


def _rank() -> int:
    try:
        from pksampler.comm import world_info

        return world_info()[0]
    except ValueError:
        return 0


def _end_loader_workers() -> None:
    """Kill this rank's DataLoader workers before it stops on an error. A worker busy fetching (an object store
    retrying) does not notice its rank is gone, and it holds the rank's stdout: horovodrun waits for that pipe to
    close and the job never ends (seen with a shard deleted from the store)."""
    from pksampler.train.runtime.rank_exit import end_loader_workers

    end_loader_workers()


def _report_and_exit(message: str, status: int) -> int:
    """One line from rank 0; every rank exits with ``status``.

    Config and data errors usually happen on every rank alike. The other ranks wait for rank 0 to print and exit
    (a launcher then stops them: they still exit with ``status``), so a loaded machine where rank 0 is slower never
    loses the message. A rank still running after the wait hit the error alone (rank 0 went on, or is stuck in a
    collective waiting for it): it prints the line itself, naming its rank, before it exits.
    """
    rank = _rank()
    _end_loader_workers()
    if rank == 0:
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        return status
    previous = signal.signal(signal.SIGTERM, lambda *_: os._exit(status))
    try:
        time.sleep(_PEER_WAIT_SECONDS)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)
    return status


#: what a rank's collective raises when a peer has exited (its own error says nothing about the cause)
_PEER_FAILED = ("HorovodInternalError", "DistBackendError")


def _report_unexpected(error: BaseException) -> int:
    """Rank 0 shows the whole traceback; the others one line naming where they failed. A collective that failed
    because a peer exited is one line on any rank: the peer reported the cause."""
    _end_loader_workers()
    if type(error).__name__ in _PEER_FAILED:
        print(f"[pksampler] rank {_rank()}: stopped: a collective failed because another rank stopped "
              f"({type(error).__name__}); that rank's error is above", file=sys.stderr, flush=True)
        time.sleep(2.0)
    elif _rank() == 0:
        traceback.print_exc()
        sys.stderr.flush()
    else:
        frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        where = f" at {frame.filename}:{frame.lineno}" if frame else ""
        print(f"[pksampler] rank {_rank()}: {type(error).__name__}: {error}{where} (traceback on rank 0)",
              file=sys.stderr, flush=True)
        time.sleep(2.0)
    return 1


def _last_line(error: BaseException) -> str:
    """The message itself, also when a DataLoader worker wrapped it with the worker's traceback."""
    line = str(error).strip().splitlines()[-1]
    name = f"{type(error).__module__}.{type(error).__name__}: "
    return line[len(name):] if line.startswith(name) else line


def main(argv: list[str] | None = None, extra_hooks: Iterable[Any] = ()) -> int:
    """Parse arguments, load the config, train; returns the exit status (2: config or data error)."""
    args = parse_args(argv)
    from pksampler.comm import adopt_local_rank

    try:
        adopt_local_rank(args.local_rank)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    from pksampler.datasets import ShardDamagedError
    from pksampler.datasets.objectstore import ObjectStoreError
    from pksampler.samplers import SamplerMismatchError
    from pksampler.train.config.load import ConfigError, load_config
    from pksampler.train.runtime.distributed import CollectiveTimeout
    from pksampler.train.engine.elastic.run import ElasticResetLoop
    from pksampler.train.engine.trainer import TrainingDiverged

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"train.resume={'true' if args.resume else 'false'}")
    path = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    try:
        config = load_config(path, overrides)
        from pksampler.train.run_setup import main as train_main

        result = train_main(config, extra_hooks)
    except (ConfigError, SamplerMismatchError) as error:
        # Every rank hits the same error (set-up failures are raised together); rank 0 reports it.
        return _report_and_exit(f"error: {error}", 2)
    except (TrainingDiverged, ElasticResetLoop) as error:
        return _report_and_exit(f"error: {error}", 1)
    except CollectiveTimeout as error:
        # The rank that stopped may be rank 0: every rank that waited says so itself.
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    except (ShardDamagedError, ObjectStoreError) as error:
        # Found by the rank that read the shard (any rank), perhaps in a DataLoader worker that wrapped it: one line
        # naming the file or s3:// object, no traceback.
        print(f"error: rank {_rank()}: {_last_line(error)}", file=sys.stderr, flush=True)
        return 2
    except Exception as error:  # noqa: BLE001 - shown once, then a non-zero exit
        return _report_unexpected(error)
    if result.final_metrics:
        print("[pksampler] final: " + " ".join(f"{k}={v:.4f}" for k, v in result.final_metrics.items()
                                               if isinstance(v, float)), flush=True)
    return 0


def exit_with(status: int) -> NoReturn:
    """Leave with ``status``; under torchrun without the interpreter's teardown, which can abort a rank that
    finished (:mod:`pksampler.train.runtime.rank_exit`)."""
    from pksampler.train.runtime.rank_exit import end_rank

    end_rank(status)
    sys.exit(status)


if __name__ == "__main__":
    exit_with(main())
