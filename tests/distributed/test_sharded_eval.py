"""Gallery-sharded evaluation on real ranks: horovodrun -np 2 and torchrun, each rank holding a share.

One launch per launcher checks: every rank gets the same metrics and
neighbours, equal to one process's evaluate_retrieval over the whole
gallery; the sampled-query evaluation equals the one-process (W = 1)
sharded run; ranks passing different query ids fail on every rank, no hang.
"""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
from launch import ROOT, launch

from pksampler.train.evaluation import evaluate_retrieval, sharded_retrieval, stratified_queries

pytestmark = pytest.mark.horovod
SCRIPT = ROOT / "tests" / "distributed" / "sharded_eval_ranks.py"


def _script():
    spec = importlib.util.spec_from_file_location("sharded_eval_ranks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lines(output: str, tag: str) -> list[dict]:
    """Each rank's JSON after ``tag rank r`` (horovodrun prefixes lines with ``[r]<stdout>:``)."""
    found = [json.loads(match) for match in re.findall(rf"^(?:\[\d\]<stdout>:)?{tag} rank \d (.*)$", output, re.M)]
    assert len(found) == 2, output[-4000:]
    return found


@pytest.mark.parametrize("launcher", ["horovodrun", "torchrun"])
def test_two_real_ranks_get_the_metrics_of_one_process_over_the_whole_gallery(launcher):
    ranks = _script()
    x, labels = ranks.gallery()
    args = ["--horovod"] if launcher == "horovodrun" else []
    result = launch(launcher, SCRIPT, *args, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]

    reference = evaluate_retrieval(x, labels, neighbour_rows=ranks.SHOWN, num_neighbours=6)
    every = _lines(result.stdout, "SHARDED-ALL")
    assert every[0]["metrics"] == every[1]["metrics"] and every[0]["neighbours"] == every[1]["neighbours"]
    assert {k: every[0]["metrics"][k] for k in reference.metrics} == reference.metrics
    assert every[0]["neighbours"] == reference.neighbours.tolist()
    assert every[0]["bytes"] > 0 and every[1]["bytes"] > 0

    sampled = _lines(result.stdout, "SHARDED-SAMPLED")
    one = sharded_retrieval(x, labels, np.arange(labels.size),
                            query_ids=stratified_queries(labels, ranks.SAMPLED, seed=2))
    assert sampled[0]["metrics"] == sampled[1]["metrics"] == json.loads(json.dumps(one.metrics))
    assert sampled[0]["queries"] == ranks.SAMPLED

    for rank in range(2):
        assert f"MISMATCH-RAISED rank {rank}" in result.stdout, result.stdout[-4000:]
