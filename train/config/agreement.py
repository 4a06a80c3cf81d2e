"""Ranks that disagree fail fast, together, with one message.

* :func:`raise_together`: a set-up step that fails on some ranks (a missing
  file, a locked workspace) makes every rank raise the same ConfigError,
  instead of the others waiting forever in the next collective.
* :func:`check_ranks_agree`: one all-gather of a digest per config key (and
  of the labels) at start-up; keys that differ are named on every rank.
  Ranks with different ``max_steps`` would otherwise hang, and ranks with
  different learning rates would silently train different models.
* :func:`check_resume_compatible`: what a resumed run may change (epochs,
  evaluation cadence, workers, ...) takes effect; what it may not (model,
  optimizer, loss, seed, data, sampler) is refused with the keys listed.

Which keys may change on resume and which may differ between ranks is said
by the schema's fields (:mod:`pksampler.train.config.schema`), not here.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from pksampler import agree
from pksampler.train.config.load import ADDED_KEYS
from pksampler.train.config.schema import local_keys, resumable_keys
from pksampler.train.errors import ConfigError

if TYPE_CHECKING:  # the backend is passed in by the application; the configuration imports no runtime
    from pksampler.train.runtime.distributed import Backend

__all__ = ["RESUMABLE_KEYS", "LOCAL_KEYS", "check_ranks_agree", "check_resume_compatible", "flatten", "raise_together"]

#: keys a resumed run may change: they take effect from the resumed step (the schema's ``resumable`` fields)
RESUMABLE_KEYS = resumable_keys()

#: keys that may differ between ranks, per-host resources (the schema's ``local`` fields)
LOCAL_KEYS = local_keys()


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: the config's sections are opened, the mappings inside a section
    (``data.args``, ``data.augment``, ``loss.memory``, ...) stay one value, so a difference names that key."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and not prefix:
            flat.update(flatten(value, path))
        else:
            flat[path] = value
    return flat


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little", signed=True)


def raise_together(backend: Backend, error: Exception | None) -> None:
    """Collective: if any rank's ``error`` is set, every rank raises the lowest failing rank's ConfigError
    (:func:`pksampler.agree.raise_together`)."""
    agree.raise_together(backend, error, kind=ConfigError)


def check_ranks_agree(config: Mapping[str, Any], labels: np.ndarray, backend: Backend) -> None:
    """Raise the same ConfigError on every rank when the resolved configs or the labels differ."""
    if backend.size == 1:
        return
    flat = {k: v for k, v in sorted(flatten(config).items()) if k not in LOCAL_KEYS}
    keys = list(flat) + ["<dataset labels>"]
    labels = np.ascontiguousarray(labels)
    label_digest = _digest((labels.dtype.str, labels.shape, hashlib.blake2b(labels.tobytes()).hexdigest()))
    row = np.array([_digest(flat[k]) for k in flat] + [label_digest, len(keys)], dtype=np.int64)
    table = backend.allgather_numpy(row)
    if np.unique(table[:, -1]).size > 1:
        raise ConfigError("ranks run different versions of pksampler (their configs have different keys)")
    differing = [keys[i] for i in range(len(keys)) if np.unique(table[:, i]).size > 1]
    if differing:
        shown = ", ".join(differing[:8]) + (" ..." if len(differing) > 8 else "")
        raise ConfigError(
            f"ranks disagree on {shown}: every rank must run the same config and data (check the environment "
            "variables and --set values each rank receives); stopping before training instead of hanging"
        )


def check_resume_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], checkpoint: str) -> None:
    """Refuse a resume whose config changes a key that would make a different run."""
    before, after = flatten(saved), flatten(current)
    if before.get("head.name") is not None and "head.lr_scale" in before:
        raise ConfigError(
            f"cannot resume from {checkpoint}: its head was trained under the earlier recipe (unit-norm rows at "
            f"head.lr_scale={before['head.lr_scale']!r} times AdamW's rate), which head.lr, head.momentum and "
            "head.weight_decay replaced; its rows would continue under another optimizer. Start afresh with "
            "--no-resume or another WORKSPACE")
    for key, value in ADDED_KEYS.items():  # a checkpoint written before the key existed ran with this value
        before.setdefault(key, value)
    headless = before.get("head.name") is None and after.get("head.name") is None
    changed = sorted(k for k in set(before) | set(after)
                     if k not in RESUMABLE_KEYS and before.get(k) != after.get(k)
                     and not (headless and k.startswith("head.")))  # no head: its keys change nothing
    if changed:
        details = "; ".join(f"{k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed[:6])
        raise ConfigError(
            f"cannot resume from {checkpoint}: the config changes {', '.join(changed)} ({details}), which a "
            "resumed run cannot take over. Start afresh with --no-resume or another WORKSPACE, or restore "
            "those values. A resume may change: " + ", ".join(sorted(RESUMABLE_KEYS))
        )
