"""Horovod elastic training, in three modules: state handlers, commits, and the run mode that drives them.

* :mod:`.handlers` -- what Horovod saves, restores and syncs per value (the
  sampler's position, the loop's state, every shared part's rows and replicas, one handler for all);
* :mod:`.commit` -- the in-memory commits, the held metrics lines written at
  each, and the rule that ``last.pt`` is taken only at a commit;
* :mod:`.run` -- :class:`~.run.HorovodElasticMode`: the loop under
  ``hvd.elastic.run``, the new world handed to every part after a reset
  (``set_world``), the workspace taken over by a new rank 0.

:func:`choose_run_mode` is the one place that decides whether a run is
Horovod elastic; ``main`` calls it once.
"""

from __future__ import annotations

from typing import Any

from pksampler.train.engine.elastic.commit import CommitHook, Commits
from pksampler.train.engine.elastic.handlers import SamplerHandler, SharedPartHandler, Shared, host_key, state_handlers
from pksampler.train.engine.elastic.run import (ELASTIC_TIMEOUT_ENV, HorovodElasticMode, elastic_launch, loop_position,
                                                rejoin_timeout)
from pksampler.train.engine.mode import RunMode

__all__ = ["CommitHook", "Commits", "ELASTIC_TIMEOUT_ENV", "HorovodElasticMode", "RunMode", "SamplerHandler",
           "SharedPartHandler", "Shared", "choose_run_mode", "elastic_launch", "horovod_elastic", "host_key",
           "loop_position", "rejoin_timeout", "state_handlers"]


def horovod_elastic(backend: Any) -> bool:
    """Whether this run is Horovod elastic: launched with a host-discovery script and on the Horovod backend.

    ``HOROVOD_ELASTIC=1`` alone (e.g. left in the environment of a torchrun job) does not make a run elastic.
    """
    return elastic_launch() and backend.name == "horovod"


def choose_run_mode(backend: Any, *, commit_every: int) -> RunMode:
    """The run mode of this process: Horovod elastic (:func:`horovod_elastic`), else the static one."""
    if horovod_elastic(backend):
        return HorovodElasticMode(backend, commit_every=commit_every)
    return RunMode(backend)
