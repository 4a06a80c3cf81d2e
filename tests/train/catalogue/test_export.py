"""The exported model runs like the eager one: onnxruntime and torch.export on real image files."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime
import pytest
import torch
from catalogue_fixtures import make_checkpoint, render_folder

from pksampler.datasets import CenterView, ToUint8, load_rgb
from pksampler.train.catalogue.export import export_model, read_metadata
from pksampler.train.catalogue.model import load_model
from pksampler.train.errors import ConfigError


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    checkpoint = make_checkpoint(folder / "best.pt", neck="batch")  # the neck embeds with its running statistics
    images = render_folder(folder / "images", classes=4, per_class=2, image_size=52)
    written = export_model(checkpoint, folder / "model")
    return checkpoint, sorted(images.rglob("*.png")), written


def _batch(paths, size):
    return torch.stack([ToUint8(size)(load_rgb(p)) for p in paths])


def test_onnx_and_pt2_match_the_eager_model_on_real_images_at_batch_1_and_7(exported):
    checkpoint, paths, written = exported
    model = load_model(checkpoint)
    session = onnxruntime.InferenceSession(str(written["onnx"]), providers=["CPUExecutionProvider"])
    program = torch.export.load(str(written["pt2"])).module()
    deltas = {}
    for batch in (1, 7):
        images = _batch(paths[:batch], model.input_size)
        with torch.no_grad():
            eager = model.network(CenterView(model.image_size)(images)).numpy()  # the trainer's evaluation path
            served = program(images).numpy()
        (onnx_out,) = session.run(["embeddings"], {"images": images.numpy()})
        assert onnx_out.shape == eager.shape == (batch, model.embedding_dim)
        deltas[batch] = (float(np.abs(onnx_out - eager).max()), float(np.abs(served - eager).max()))
    assert all(d <= 1e-5 for pair in deltas.values() for d in pair), deltas
    print("max |delta| vs eager (onnx, pt2):", deltas)


def test_the_preprocessing_and_digest_are_in_both_files(exported):
    checkpoint, _, written = exported
    model = load_model(checkpoint)
    for path in written.values():
        meta = read_metadata(path)
        assert meta["digest"] == model.digest
        pre = meta["preprocessing"]
        assert (pre["input_size"], pre["crop_size"], pre["dtype"], pre["channel_order"]) == (27, 24, "uint8", "RGB")
        assert pre["mean"] == pytest.approx([0.485, 0.456, 0.406]) and pre["std"] == pytest.approx([0.229, 0.224, 0.225])
    session = onnxruntime.InferenceSession(str(written["onnx"]), providers=["CPUExecutionProvider"])
    shape = session.get_inputs()[0].shape
    assert isinstance(shape[0], str) and shape[1:] == [3, 27, 27]  # a dynamic batch axis
    assert json.loads(session.get_modelmeta().custom_metadata_map["pksampler"])["digest"] == model.digest


def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path):
    bad = tmp_path / "best.pt"
    torch.save({"weights": torch.zeros(2)}, bad)
    with pytest.raises(ConfigError, match=r"best\.pt.*'model' and 'config'"):
        export_model(bad, tmp_path / "model")
    with pytest.raises(ConfigError, match=r"--formats: 'tflite'"):
        export_model(bad, tmp_path / "model", formats=("tflite",))


def test_random_bytes_are_not_a_readable_checkpoint_named_as_typed_without_trainer_advice(tmp_path):
    import subprocess
    import sys

    from launch import ROOT

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ConfigError) as caught:
        export_model(garbage, tmp_path / "model")
    message = str(caught.value)
    assert message.startswith(f"checkpoint: {garbage} is not a readable checkpoint"), message
    assert "objects other than tensors" not in message and "--no-resume" not in message and "WORKSPACE" not in message
    with pytest.raises(ConfigError, match=r"^--checkpoint: .*garbage\.pt is not a readable checkpoint"):
        load_model(garbage)  # embed and query take it as --checkpoint
    with pytest.raises(ConfigError, match=r"^checkpoint: .*missing\.pt does not exist"):
        export_model(tmp_path / "missing.pt", tmp_path / "model")
    # the command line: one line, no traceback
    result = subprocess.run([sys.executable, str(ROOT / "train" / "export_model.py"), str(garbage), "--out",
                             str(tmp_path / "m2")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: checkpoint: {garbage} is not a readable checkpoint (not a "
                                                  "torch file, or damaged); pass a best.pt or last.pt written by "
                                                  "train/retrieval.py"]


def _documented_decode(path, pre):
    """A server's decode, written from the exported metadata alone: what a service following it would do."""
    from PIL import Image

    with Image.open(path) as image:
        draft = pre.get("jpeg_draft")
        if draft and image.format == "JPEG":
            image.draft("RGB", (draft, draft))
        image = image.convert("RGB")
        width, height = image.size
        side, size = min(width, height), pre["input_size"]
        left, top = (width - side) // 2, (height - side) // 2
        square = image.resize((size, size), Image.BILINEAR, box=(left, top, left + side, top + side))
    return torch.from_numpy(np.asarray(square).copy()).permute(2, 0, 1)


def test_a_camera_sized_jpeg_embeds_the_same_through_the_documented_decode_and_the_catalogue(exported, tmp_path):
    from PIL import Image

    from pksampler.train.catalogue.sources import open_source

    checkpoint, _, written = exported
    model = load_model(checkpoint)
    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:480, 0:640]
    photo = np.stack([128 + 100 * np.sin(x / 23.0 + c) * np.cos(y / 31.0 - c) for c in range(3)], axis=-1)
    photo = np.clip(photo + rng.normal(0, 12, photo.shape), 0, 255).astype(np.uint8)
    (tmp_path / "cat" / "product").mkdir(parents=True)
    Image.fromarray(photo).save(tmp_path / "cat" / "product" / "photo.jpg", quality=90)
    dataset = open_source(str(tmp_path / "cat"), decode_size=model.input_size)  # as embed_catalogue opens it
    dataset.transform = model.worker_transform()
    serving = model.serving()
    pre = read_metadata(written["onnx"])["preprocessing"]
    assert pre == read_metadata(written["pt2"])["preprocessing"] == model.preprocessing
    with torch.no_grad():
        catalogue = serving(dataset[0][0][None]).numpy()
        documented = serving(_documented_decode(tmp_path / "cat" / "product" / "photo.jpg", pre)[None]).numpy()
        full = serving(_documented_decode(tmp_path / "cat" / "product" / "photo.jpg",
                                          {**pre, "jpeg_draft": None})[None]).numpy()
    assert float(np.abs(documented - catalogue).max()) <= 1e-5
    assert float(np.abs(full - catalogue).max()) > 1e-4  # the draft step matters: a full decode embeds elsewhere
