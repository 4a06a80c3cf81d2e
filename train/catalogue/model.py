"""The embedding network of a training checkpoint, its preprocessing, and a digest that names it.

A checkpoint (``best.pt`` or ``last.pt``) holds the model's tensors and the
run's config; the config rebuilds the architecture (:func:`build_model`) and
says how images were prepared for evaluation:

1. decode (a JPEG in Pillow's draft mode, ``Image.draft("RGB", (input_size,
   input_size))`` before it is loaded: the DCT scale 1/2, 1/4 or 1/8 that
   keeps both sides at least ``input_size``, as every dataset decodes), take
   the centre square of the short side, resize it (Pillow, bilinear) to
   ``input_size = round(image_size * 8 / 7)``: uint8 RGB, what the trainer's
   workers ship (:class:`~pksampler.datasets.ToUint8`);
2. crop the centre ``image_size`` square, scale to [0, 1], subtract the
   ImageNet mean and divide by its std (:class:`~pksampler.datasets.CenterView`).

:class:`ServingModel` holds step 2 and the network, so a served model takes
step 1's uint8 batch ``(N, 3, input_size, input_size)`` and returns
L2-normalised float32 embeddings. The digest is a SHA-256 of the tensors
(names, dtypes, shapes, bytes) and the preprocessing: embeddings, indexes and
exported files carry it, so a query can tell that they come from one model.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pksampler.datasets import CenterView, ToUint8
from pksampler.datasets.transforms import IMAGENET_MEAN, IMAGENET_STD

from pksampler.train.builders import eval_size
from pksampler.train.config.load import saved_config
from pksampler.train.engine.checkpoint import CheckpointError
from pksampler.train.errors import ConfigError
from pksampler.train.modeling.model import build_model

__all__ = ["LoadedModel", "ServingModel", "check_finite", "load_model", "preprocessing_of"]


#: fields that describe the decode every catalogue has always used; left out of the digest, so the digests of
#: catalogues and indexes written before they were recorded still name the same model
_UNDIGESTED = ("decode", "jpeg_draft")


def preprocessing_of(image_size: int) -> dict[str, Any]:
    """What a served model expects, as plain data (written into every exported file and manifest)."""
    return {
        "input": "uint8 RGB, layout NCHW, shape (batch, 3, input_size, input_size)",
        "input_size": eval_size(image_size),
        "decode": "Pillow; a JPEG in draft mode first: Image.draft('RGB', (jpeg_draft, jpeg_draft)) before load() "
                  "(the DCT scale 1/2, 1/4 or 1/8 keeping both sides >= jpeg_draft), then convert('RGB')",
        "jpeg_draft": eval_size(image_size),
        "resize": "centre square of the short side, resized with Pillow's bilinear filter to input_size",
        "channel_order": "RGB",
        "dtype": "uint8",
        "layout": "NCHW",
        "crop_size": image_size,
        "inside_the_model": "centre crop to crop_size, x / 255, (x - mean) / std",
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
        "output": "float32 (batch, embedding_dim), L2-normalised: inner product = cosine similarity",
    }


class ServingModel(nn.Module):
    """uint8 ``(N, 3, input_size, input_size)`` -> L2-normalised embeddings: the centre crop, scaling and
    normalisation of evaluation (:class:`CenterView`), then the network."""

    def __init__(self, network: nn.Module, image_size: int) -> None:
        super().__init__()
        self.network = network
        self.view = CenterView(image_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.network(self.view(images))


@dataclass
class LoadedModel:
    """A checkpoint's network in eval mode on the CPU, with what it needs and what names it."""

    network: nn.Module
    image_size: int
    embedding_dim: int
    digest: str
    checkpoint: Path
    preprocessing: dict[str, Any] = field(default_factory=dict)

    @property
    def input_size(self) -> int:
        return int(self.preprocessing["input_size"])

    def serving(self) -> ServingModel:
        return ServingModel(self.network, self.image_size).eval()

    def worker_transform(self) -> ToUint8:
        """Step 1 of the preprocessing, as the DataLoader workers run it."""
        return ToUint8(self.input_size)

    def describe(self) -> dict[str, Any]:
        """The model's entry in manifests and metadata."""
        return {"digest": self.digest, "checkpoint": str(self.checkpoint), "embedding_dim": self.embedding_dim,
                "preprocessing": self.preprocessing}


def _digest(tensors: dict[str, torch.Tensor], preprocessing: dict[str, Any]) -> str:
    described = {key: value for key, value in preprocessing.items() if key not in _UNDIGESTED}
    hasher = hashlib.sha256(json.dumps(described, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        hasher.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return hasher.hexdigest()


def _read_checkpoint(path: Path, argument: str) -> dict[str, Any]:
    """The checkpoint's dict, read with ``weights_only=True``; one CheckpointError naming ``argument`` otherwise.

    The trainer's reader advises trainer flags (``--no-resume``); these
    commands only read a file, so their messages say what the file is not.
    """
    if not path.is_file():
        raise CheckpointError(f"{argument}: {path} does not exist or is not a file; pass a best.pt or last.pt "
                              "written by train/retrieval.py")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        text = " ".join(str(error).split())
        if "Unsupported global" in text or "Unsupported class" in text:
            raise CheckpointError(f"{argument}: {path} was refused: it holds objects other than tensors and plain "
                                  "data, and loading it could run code; pass a best.pt or last.pt written by "
                                  "train/retrieval.py") from None
        raise CheckpointError(f"{argument}: {path} is not a readable checkpoint (not a torch file, or damaged); "
                              "pass a best.pt or last.pt written by train/retrieval.py") from None
    except Exception as error:  # truncated zip, not a torch file, ...
        raise CheckpointError(f"{argument}: {path} is not a readable checkpoint ({type(error).__name__}: "
                              f"{' '.join(str(error).split())[:200]}); pass a best.pt or last.pt written by "
                              "train/retrieval.py") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{argument}: {path} holds a {type(state).__name__}, not a pksampler training "
                              "checkpoint; pass a best.pt or last.pt written by train/retrieval.py")
    return state


def load_model(checkpoint: str | Path, *, argument: str = "--checkpoint") -> LoadedModel:
    """The network of ``checkpoint`` (read with ``weights_only=True``), ready to embed on the CPU.

    Raises a ConfigError naming ``argument`` (as the command line spells it)
    and the file when it is not a pksampler training checkpoint or its
    tensors do not fit the architecture its config names.
    """
    path = Path(checkpoint)
    state = _read_checkpoint(path, argument)
    if not isinstance(state.get("model"), dict) or not isinstance(state.get("config"), dict):
        raise CheckpointError(f"{argument}: {path} holds no 'model' and 'config' sections; pass a best.pt or "
                              "last.pt written by train/retrieval.py")
    config = saved_config(state["config"])
    network = build_model(config.model, image_size=config.data.image_size)
    try:
        network.load_state_dict(state["model"])
    except RuntimeError as error:
        reason = " ".join(str(error).split())[:300]
        raise ConfigError(f"{argument}: {path}: its tensors do not fit the model its config names ({reason})") \
            from None
    network.eval()
    preprocessing = preprocessing_of(config.data.image_size)
    return LoadedModel(network=network, image_size=config.data.image_size,
                       embedding_dim=config.model.embedding_dim, digest=_digest(state["model"], preprocessing),
                       checkpoint=path, preprocessing=preprocessing)


def check_finite(embeddings: np.ndarray, where: str) -> None:
    """Refuse NaN or infinite embeddings (a diverged model) with a message naming where they came from."""
    if not np.isfinite(embeddings).all():
        raise ConfigError(f"{where}: the model produced NaN or infinite embeddings; the checkpoint is damaged or "
                          "the run diverged")
