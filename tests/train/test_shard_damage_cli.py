"""A damaged shard met during training ends the run with one line naming it, not a traceback."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np
from PIL import Image

from pksampler.datasets.pack import pack

ROOT = Path(__file__).resolve().parents[2]


def retrieval_main():
    spec = importlib.util.spec_from_file_location("retrieval_script", ROOT / "train" / "retrieval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_a_damaged_shard_is_one_line_naming_it(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for c in range(8):
        for i in range(4):
            (tmp_path / "src" / f"c{c}").mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(buffer, format="PNG")
            (tmp_path / "src" / f"c{c}" / f"{i}.png").write_bytes(buffer.getvalue())
    shards = tmp_path / "shards"
    manifest = pack(tmp_path / "src", shards, shard_size="16KB")
    for entry in manifest["shards"]:
        with open(shards / entry["name"], "r+b") as handle:  # same size, other bytes
            handle.seek(700)
            handle.write(b"\x55" * 8)
    status = retrieval_main()([
        "--set", "data.name=shards", "--set", f"data.root={shards}", "--set", "data.args={}",
        "--set", "data.image_size=16", "--set", "data.workers=0", "--set", "sampler.classes_per_step=2",
        "--set", "sampler.samples_per_class=2", "--set", "model.width=8", "--set", "model.depth=[1, 1]",
        "--set", "train.tensorboard=false", "--set", f"workspace={tmp_path / 'run'}", "--set", "train.max_steps=2"])
    err = capsys.readouterr().err
    assert status == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "error: rank 0: ShardedDataset: shard " in lines[0]
    assert "does not match its fingerprint" in lines[0]
