"""``model.pretrained``: a backbone's weights from a ``.pth`` or ``.safetensors`` file, checked tensor by tensor.

1. Read: ``.safetensors`` with the ``safetensors`` package; anything else
   with ``torch.load(weights_only=True)``, whose unpickler accepts only
   tensors and plain data, so a planted file cannot run code. A checkpoint
   that wraps the weights in ``{"state_dict": ...}`` or ``{"model": ...}``
   (Lightning, timm's training script, this trainer's own ``last.pt``) is
   unwrapped, and a ``module.`` prefix (DistributedDataParallel) dropped.
2. The ImageNet classifier (``fc.*``, ``head.*``) is set aside: the
   embedding head replaces it.
3. Every other tensor must match the backbone's by name and shape, and every
   backbone tensor must come from the file; anything missing, unexpected or
   mis-shaped is one :class:`ConfigError` that names the tensors and the file.
   ``num_batches_tracked`` may be absent (timm's files leave it out; it only
   matters for BatchNorm with ``momentum=None``).
4. A ViT's ``pos_embed`` learnt on another grid is resampled bicubically to
   the backbone's grid, the class token's embedding kept (:mod:`.vit`).

:func:`load_pretrained` is the collective used by the trainer: rank 0 reads
the file (the other ranks receive the weights with the start-up broadcast, so
only rank 0 needs the file) and a failure is raised on every rank.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from pksampler.train.errors import ConfigError

__all__ = ["CLASSIFIER_PREFIXES", "load_backbone_weights", "load_pretrained", "read_state_dict"]

#: tensors of the ImageNet classifier, never loaded (torchvision/timm ResNets: ``fc``; timm ViTs: ``head``)
CLASSIFIER_PREFIXES = ("fc.", "head.")
_KEY = "model.pretrained"
_SHOWN = 6


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a ``.pth``/``.pt``/``.bin`` (weights only) or ``.safetensors`` file, on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{_KEY}: no such file: {path}")
    if path.suffix == ".safetensors":
        state = _read_safetensors(path)
    else:
        state = _read_torch(path)
    state = _unwrap(state, path)
    if all(key.startswith("module.") for key in state):
        state = {key[len("module."):]: value for key, value in state.items()}
    return state


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as error:  # safetensors raises its own SafetensorError for a bad header
        raise ConfigError(f"{_KEY}: {path} is not a readable .safetensors file ({error})") from None


def _read_torch(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).splitlines()[0][:200]
        raise ConfigError(f"{_KEY}: {path} was refused: it holds objects other than tensors and plain data, "
                          f"and loading it could run code ({reason}); save the weights with "
                          "torch.save(model.state_dict(), path) or as .safetensors") from None
    except Exception as error:  # truncated, not a torch file, ...
        raise ConfigError(f"{_KEY}: {path} could not be read: {type(error).__name__}: {error}") from None


def _unwrap(state: Any, path: Path) -> dict[str, torch.Tensor]:
    """The state dict itself, from a bare one or from a checkpoint holding it under ``state_dict``/``model``."""
    if isinstance(state, Mapping) and not all(isinstance(v, torch.Tensor) for v in state.values()):
        for key in ("state_dict", "model"):
            if isinstance(state.get(key), Mapping):
                state = state[key]
                break
    if not isinstance(state, Mapping) or not state:
        raise ConfigError(f"{_KEY}: {path} holds no state dict (a mapping of tensor names to tensors, or a "
                          f"checkpoint with one under 'state_dict' or 'model')")
    names = [repr(k) for k in state if not isinstance(k, str)]
    if names:
        raise ConfigError(f"{_KEY}: {path}: tensor names must be strings, found {_listed(names)}")
    wrong = [str(k) for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if wrong:
        raise ConfigError(f"{_KEY}: {path}: entries that are not tensors: {', '.join(wrong[:_SHOWN])}")
    odd = [f"{k} ({'meta' if v.is_meta else v.layout})" for k, v in state.items()
           if v.is_meta or v.layout != torch.strided]
    if odd:  # a meta tensor holds no values; sparse ones do not load into a module's dense parameters
        raise ConfigError(f"{_KEY}: {path}: tensors must be dense and hold values, found {_listed(odd)}")
    return dict(state)


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _resample_pos_embed(backbone: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """A ViT's position embeddings resampled to the backbone's grid when only the number of positions differs."""
    grid = getattr(backbone, "grid", None)
    stored, wanted = state.get("pos_embed"), getattr(backbone, "pos_embed", None)
    if grid is None or stored is None or wanted is None or stored.shape == wanted.shape:
        return
    if stored.dim() == 3 and stored.shape[::2] == wanted.shape[::2]:
        from pksampler.train.modeling.vit import resample_pos_embed

        try:
            state["pos_embed"] = resample_pos_embed(stored, grid)
        except ValueError:
            pass  # not a square grid: reported below as a mis-shaped tensor


def load_backbone_weights(backbone: nn.Module, path: str | os.PathLike, *, name: str = "backbone") -> list[str]:
    """Load ``path`` into ``backbone`` after checking every tensor; returns the classifier tensors set aside.

    Raises:
        ConfigError: the file is missing, unreadable or refused, or any backbone tensor is missing from it,
            unexpected or of another shape (each named, with the file and ``name``, the backbone).
    """
    state = read_state_dict(path)
    ignored = sorted(k for k in state if k.startswith(CLASSIFIER_PREFIXES))
    state = {k: v for k, v in state.items() if not k.startswith(CLASSIFIER_PREFIXES)}
    _resample_pos_embed(backbone, state)
    expected = backbone.state_dict()
    missing = [k for k in expected if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} (file {tuple(state[k].shape)}, backbone {tuple(v.shape)})" for k, v in expected.items()
              if k in state and state[k].shape != v.shape]
    problems = [f"{len(names)} {what}: {_listed(names)}" for what, names in (
        ("missing from the file", missing), ("unexpected", unexpected), ("of another shape", shapes)) if names]
    if problems:
        raise ConfigError(f"{_KEY}: {path} does not fit backbone {name!r}: " + "; ".join(problems)
                          + ". Every backbone tensor must come from the file with torchvision's (ResNets) or "
                          "timm's (ViTs) names; only the classifier (fc.*, head.*) is left out")
    backbone.load_state_dict({**expected, **state}, strict=True)
    return ignored


def load_pretrained(model: nn.Module, path: str, backend: Any, *, name: str) -> None:
    """Collective: rank 0 loads ``path`` into ``model.backbone``; every rank raises the same error if it fails.

    The other ranks keep their initial weights until the start-up broadcast of
    rank 0's parameters and buffers, which every backend does before training.
    """
    from pksampler.train.config.agreement import raise_together

    error = None
    if backend.rank == 0:
        try:
            backbone = getattr(model, "backbone", None)
            if not isinstance(backbone, nn.Module):
                raise ConfigError(f"{_KEY}: backbone {name!r} takes no pretrained weights (the demo network has "
                                  "none published); use resnet18/34/50/101, vit_small_patch16, vit_base_patch16 "
                                  "or torchvision:<name>")
            load_backbone_weights(backbone, path, name=name)
        except ConfigError as caught:
            error = caught
    raise_together(backend, error)
