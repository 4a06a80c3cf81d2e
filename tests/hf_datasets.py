"""Hugging Face ``datasets`` as the tests see it, whatever the working directory.

The repository's own ``datasets/`` folder (installed as ``pksampler.datasets``)
shadows the Hugging Face package for a Python started in the repository root,
as ``python -m pytest`` is (it puts the root on ``sys.path``). Users import
``datasets`` from their own projects and never meet this; the tests import the
installed package once, with the root left out of the search, so later
``import datasets`` (the doc snippets included) find it in ``sys.modules``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def import_hf_datasets() -> ModuleType:
    """The installed Hugging Face ``datasets`` package (also left in ``sys.modules['datasets']``)."""
    loaded = sys.modules.get("datasets")
    if loaded is not None and hasattr(loaded, "Dataset"):
        return loaded
    sys.modules.pop("datasets", None)
    saved = sys.path[:]
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
    try:
        return importlib.import_module("datasets")
    finally:
        sys.path[:] = saved
