"""The trainer's error types, below every other module so any layer can raise them.

:class:`ConfigError` is raised for bad configuration values and for data,
checkpoint and workspace problems that a user fixes by changing an input: its
message names the key or the file, the value and the rule. The launcher
(``train/retrieval.py``) prints it as one line on rank 0.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A configuration or data problem; the message names the key (dotted path) or file, the value and the rule."""
