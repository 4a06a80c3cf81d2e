"""The trainer's error types, below every other module so any layer can raise them.

:class:`ConfigError` is raised for bad configuration values and for data,
checkpoint and workspace problems that a user fixes by changing an input: its
message names the key or the file, the value and the rule. The launcher
(``train/retrieval.py``) prints it as one line on rank 0.
"""

from __future__ import annotations

__all__ = ["ConfigError", "SharedConfigError"]


class ConfigError(ValueError):
    """A configuration or data problem; the message names the key (dotted path) or file, the value and the rule."""


class SharedConfigError(ConfigError):
    """A ConfigError that several ranks raise from one agreed table (:mod:`pksampler.agree`): rank 0 shows its line,
    the others stay quiet, so the line is read once."""
