"""Export a checkpoint's embedding model for serving: ONNX with a dynamic batch axis, and ``torch.export`` (.pt2).

Both files take the uint8 batch of :func:`~.model.preprocessing_of` and carry
the preprocessing, the model digest and the embedding size in their metadata
(ONNX ``metadata_props``; the ``.pt2`` archive's extra file
``pksampler.json``), so a server needs nothing but the file. Both are written
atomically. ``onnx`` and ``onnxruntime`` come from the ``export`` extra.

Example::

    written = export_model("workspace/demo/checkpoints/best.pt", "workspace/demo/model")
    # {'onnx': .../model.onnx, 'pt2': .../model.pt2}
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from pksampler.files import atomic_write_bytes

from pksampler.train.catalogue.model import LoadedModel, load_model
from pksampler.train.catalogue.parts import make_out_folder
from pksampler.train.errors import ConfigError

__all__ = ["EXPORT_FORMATS", "METADATA_KEY", "export_model", "export_onnx", "export_program", "read_metadata"]

#: what :func:`export_model` can write
EXPORT_FORMATS = ("onnx", "pt2")
#: the metadata entry (ONNX property, .pt2 extra file stem) holding the JSON description
METADATA_KEY = "pksampler"
#: the ONNX opset written
OPSET = 18


def metadata_of(model: LoadedModel) -> dict[str, Any]:
    """The description written into every exported file."""
    return {"format": "pksampler-embedding-model", "version": 1, **model.describe(),
            "input_name": "images", "output_name": "embeddings"}


def _example(model: LoadedModel, batch: int = 2) -> torch.Tensor:
    return torch.zeros(batch, 3, model.input_size, model.input_size, dtype=torch.uint8)


def export_onnx(model: LoadedModel, path: str | Path) -> Path:
    """Write the serving model as ONNX (input ``images``, output ``embeddings``, batch axis dynamic)."""
    try:
        import onnx
    except ImportError:
        raise ConfigError("--formats: onnx needs the 'onnx' package: pip install 'pksampler[export]'") from None
    path = Path(path)
    with tempfile.TemporaryDirectory(dir=path.parent if path.parent.is_dir() else None) as scratch:
        raw = Path(scratch) / "raw.onnx"
        with warnings.catch_warnings():
            # The TorchScript-based exporter traces once: it warns that the input checks of the centre crop
            # (dtype, rank, side) become constants, which is what they are for a fixed input size.
            warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            torch.onnx.export(model.serving(), (_example(model),), str(raw), input_names=["images"],
                              output_names=["embeddings"],
                              dynamic_axes={"images": {0: "batch"}, "embeddings": {0: "batch"}},
                              opset_version=OPSET, dynamo=False)
        proto = onnx.load(str(raw))
    onnx.checker.check_model(proto)
    entry = proto.metadata_props.add()
    entry.key, entry.value = METADATA_KEY, json.dumps(metadata_of(model), sort_keys=True)
    proto.producer_name = "pksampler"
    return atomic_write_bytes(path, proto.SerializeToString())


def export_program(model: LoadedModel, path: str | Path) -> Path:
    """Write the serving model as a ``torch.export`` program (``torch.export.load(path).module()`` runs it)."""
    import io

    batch = torch.export.Dim("batch", min=1, max=65536)
    program = torch.export.export(model.serving(), (_example(model),), dynamic_shapes=({0: batch},))
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={f"{METADATA_KEY}.json": json.dumps(metadata_of(model))})
    return atomic_write_bytes(path, buffer.getvalue())


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The description inside an exported ``.onnx`` or ``.pt2`` file."""
    path = Path(path)
    if path.suffix == ".onnx":
        import onnx

        props = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        if METADATA_KEY not in props:
            raise ConfigError(f"{path}: no {METADATA_KEY!r} metadata; not exported by pksampler")
        return json.loads(props[METADATA_KEY])
    extra = {f"{METADATA_KEY}.json": ""}
    torch.export.load(str(path), extra_files=extra)
    return json.loads(extra[f"{METADATA_KEY}.json"])


def export_model(checkpoint: str | Path, out: str | Path, *, formats: tuple[str, ...] = EXPORT_FORMATS,
                 checkpoint_argument: str = "checkpoint") -> dict[str, Path]:
    """Export ``checkpoint`` into the folder ``out`` as ``model.onnx`` and/or ``model.pt2``; returns the paths.

    ``checkpoint_argument`` is how errors name the checkpoint (export_model.py takes it as a positional argument).
    """
    unknown = [f for f in formats if f not in EXPORT_FORMATS]
    if unknown or not formats:
        raise ConfigError(f"--formats: {','.join(formats)!r} must be one or more of {list(EXPORT_FORMATS)}")
    model = load_model(checkpoint, argument=checkpoint_argument)
    out = make_out_folder(out)
    writers = {"onnx": export_onnx, "pt2": export_program}
    return {name: writers[name](model, out / f"model.{name}") for name in formats}
