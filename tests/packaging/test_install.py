"""The installed distribution: one import namespace, nothing shadowed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from launch import ROOT


def run_python(code: str, cwd) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_no_top_level_datasets_samplers_or_train_module(tmp_path):
    # Run outside the checkout so the working directory cannot hide a problem.
    out = run_python(
        "import importlib.util, json;"
        "print(json.dumps({n: getattr(importlib.util.find_spec(n), 'origin', None)"
        " for n in ('datasets', 'samplers', 'train')}))",
        cwd=tmp_path,
    )
    found = __import__("json").loads(out)
    for name, origin in found.items():
        # another distribution's package of that name (Hugging Face's `datasets`, a dev dependency) is fine;
        # the checkout's own folder importable under the bare name is not
        ours = origin is not None and Path(origin).resolve().parent == (ROOT / name).resolve()
        assert not ours, f"installing pksampler created top-level {name!r} at {origin}"


def test_subpackages_resolve_to_the_top_level_folders(tmp_path):
    out = run_python(
        "import pksampler, pksampler.samplers, pksampler.datasets, pksampler.train;"
        "from pksampler import DistributedBalancedSampler;"
        "print(pksampler.samplers.__file__); print(pksampler.datasets.__file__); print(pksampler.train.__file__)",
        cwd=tmp_path,
    )
    samplers, datasets, train = out.split()
    assert samplers == str(ROOT / "samplers" / "__init__.py")
    assert datasets == str(ROOT / "datasets" / "__init__.py")
    assert train == str(ROOT / "train" / "__init__.py")


def test_samplers_do_not_import_horovod_or_faiss(tmp_path):
    out = run_python(
        "import sys, pksampler.samplers; print('horovod' in sys.modules, 'faiss' in sys.modules)", cwd=tmp_path
    )
    assert out.split() == ["False", "False"]


def test_the_library_imports_no_framework(tmp_path):
    """The frameworks extra stays optional: building a sampler from labels imports none of them."""
    code = ("import sys, numpy as np, pksampler, pksampler.samplers as s;"
            "s.DistributedBalancedBatchSampler(np.arange(100) % 10, 2, 2, num_replicas=1, rank=0);"
            "print(sorted(m for m in ('lightning', 'accelerate', 'torchdata', 'datasets', 'pyarrow', 'pandas')"
            " if m in sys.modules))")
    assert run_python(code, cwd=tmp_path).strip() == "[]"
