"""The smallest training run the trainer's unit tests share: 24 synthetic classes of 6 images, a two-stage net.

Each test adds what it is about (``*extra`` overrides, last wins): ``load_config(None, [*TINY, *extra])``.
"""

from __future__ import annotations

TINY = [
    "seed=3",
    "data.args={num_classes: 24, images_per_class: 6, image_size: 32}",
    "data.image_size=24", "data.workers=0",
    "sampler.classes_per_step=4", "sampler.samples_per_class=3",
    "model.width=8", "model.depth=[1, 1]", "model.embedding_dim=16",
    "loss.name=batch_hard", "optim.lr=0.003", "optim.base_batch=12", "optim.warmup_steps=3",
    "train.epochs=2", "train.eval_every=2", "train.checkpoint_every=0", "train.gallery_queries=3",
    "train.tensorboard=false",
]


def grown_folders(root) -> tuple:
    """Two image folders of synthetic products (32 px, 6 views): week 1 holds products 0-23, week 2 products 2-31
    (two left, eight came, so every class code shifts by two: only names match). Returns (week1, week2)."""
    from pksampler.datasets import SyntheticProducts

    every = SyntheticProducts(32, 6, image_size=32, root=root / "all")
    folders = (root / "week1", root / "week2")
    for out, codes in zip(folders, (range(0, 24), range(2, 32))):
        for code in codes:
            name = every.classes[code]
            (out / name).mkdir(parents=True, exist_ok=True)
            for image in (root / "all" / name).iterdir():
                (out / name / image.name).write_bytes(image.read_bytes())
    return folders


def folder_keys() -> list[str]:
    """configs/folder.yaml's model, loss and head blocks as ``--set`` overrides (its recipe on other data)."""
    import json
    from pathlib import Path

    import yaml

    tree = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "folder.yaml").read_text())
    return [f"{block}.{key}={json.dumps(value)}" for block in ("model", "loss", "head")
            for key, value in tree[block].items()]


def read_trained(path) -> dict:
    """A training checkpoint with its sharded head's rows inside (read from the range files beside it, when it
    has them), so tests compare rows and momentum whichever layout wrote them."""
    from pksampler.train.engine.checkpoint import load_checkpoint
    from pksampler.train.losses.headed import whole_loss_state
    from pksampler.train.modeling.range_checkpoint import located

    state = located(load_checkpoint(path), path)
    return {**state, "loss": whole_loss_state(state["loss"])}
