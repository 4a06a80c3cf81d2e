"""The run configuration, the bottom layer of the trainer: the schema (frozen dataclasses whose
fields carry their rules), the rules, the loader (YAML, environment, ``--set``), the agreement
checks across ranks and resumes, and the registry of choices that the layers above fill.

Imports only :mod:`pksampler.train.errors` and the library core.
"""

from __future__ import annotations

from pksampler.train.config.load import load_config

__all__ = ['load_config']
