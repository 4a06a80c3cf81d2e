"""Train a retrieval embedding with P x K batches on every rank.

Usage::

    horovodrun -np 16 python train/retrieval.py [--config configs/products.yaml] [--set key=value ...]
    torchrun --nproc_per_node 2 train/retrieval.py --set distributed.backend=torch
    python train/retrieval.py                      # one process, the synthetic default

With no arguments it trains on the built-in synthetic product set
(configs/demo.yaml). Environment variables of the training platform override
the file: DATASETS_PATH, DATASETS, WORKSPACE, EPOCHS, LR, BATCH_SIZE,
WORKER_PER_NODE; ``--set`` overrides both.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a script, Python puts train/ first on sys.path; drop it so module
# names in this folder cannot shadow installed packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

DEFAULT_CONFIG = HERE.parent / "configs" / "demo.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None,
                        help=f"YAML run config (default: {DEFAULT_CONFIG.relative_to(HERE.parent)})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.epochs=3 (repeatable)")
    parser.add_argument("--resume", dest="resume", action="store_true", default=None,
                        help="continue from WORKSPACE/checkpoints/last.pt (the default when it exists)")
    parser.add_argument("--no-resume", dest="resume", action="store_false", help="start afresh")
    return parser.parse_args(argv)


def _rank_from_environment() -> int:
    from pksampler.samplers import world_info

    try:
        return world_info()[0]
    except ValueError:
        return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pksampler.train.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"train.resume={'true' if args.resume else 'false'}")
    path = args.config if args.config is not None else (DEFAULT_CONFIG if DEFAULT_CONFIG.is_file() else None)
    try:
        config = load_config(path, overrides)
        from pksampler.train.trainer import main as train_main

        result = train_main(config)
    except (ConfigError, FileNotFoundError) as error:
        # Every rank hits the same error; only rank 0 reports it.
        if _rank_from_environment() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if result.final_metrics:
        print("[pksampler] final: " + " ".join(f"{k}={v:.4f}" for k, v in result.final_metrics.items()
                                               if isinstance(v, float)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
