"""Several short trainings in one launch (a launch costs ~20 s): one backend, one run per named config.

``python trace_runs.py RUNS.json``: RUNS.json maps a run's name to its config
(a YAML path or null for the default) and ``--set`` overrides; each rank
trains them in order, each in ``<workspace root>/<name>``, so one launch per
world size serves every config a trace check compares.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pksampler.train.config.load import load_config
from pksampler.train.engine.elastic import choose_run_mode
from pksampler.train.run_setup import train
from pksampler.train.runtime.distributed import make_backend


def run_all(runs_file: Path) -> None:
    spec = json.loads(runs_file.read_text())
    configs = {name: load_config(run["config"], [*run["set"], f"workspace={Path(spec['root']) / name}"], environ={})
               for name, run in spec["runs"].items()}
    first = next(iter(configs.values()))
    backend = make_backend(first.distributed.backend, device=first.train.device, precision=first.train.precision,
                           collective_timeout=first.train.collective_timeout)
    try:
        for config in configs.values():
            train(config, backend, mode=choose_run_mode(backend, commit_every=config.train.commit_every))
        backend.barrier()
    finally:
        backend.shutdown()


if __name__ == "__main__":
    run_all(Path(sys.argv[1]))
    # Every run is written and the process group destroyed. Several DDP-wrapped trainings in one process leave
    # C++ threads that the interpreter's teardown can destroy while joinable ("terminate called without an active
    # exception", SIGABRT, seen under torchrun with a loaded machine): end here instead of tearing down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
