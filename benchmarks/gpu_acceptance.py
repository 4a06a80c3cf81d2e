"""GPU acceptance run: four checks for the first machine with a GPU, one function each.

Run (on the GPU machine, after ``make setup``, which builds Horovod with NCCL there):

    .venv/bin/python benchmarks/gpu_acceptance.py [--parts 1,2,3,4] [--workdir DIR] [--out results.json]

1. **Parity** (:func:`parity`): our ``resnet50`` against torchvision's with the
   same weights (torchvision's random initialisation, BatchNorm statistics
   randomised, written as a ``.pth`` and loaded through ``model.pretrained``),
   and ``torchvision:resnet50`` loaded from the same file: pooled fp32
   features on the GPU, TF32 off; passes at max |difference| <= 1e-5.
2. **Demo on one GPU** (:func:`demo_recalls`): ``configs/demo.yaml`` under
   ``torchrun --nproc_per_node 1`` on the CPU (fp32, the reference) and on the
   GPU in fp32 and bf16; held-out Recall@1 of each, and whether the GPU runs
   lie within ``--tolerance`` (default 0.02, about the spread of the demo over
   world sizes and seeds) of the CPU run.
3. **Input pipeline** (:func:`pipeline_ratio`): ResNet-50 at 224 px, bf16,
   channels_last, training steps (forward, multi-similarity loss, backward,
   SGD) fed by our loader from packed shards (the trainer's dataset,
   transforms, P x K sampler and DataLoader with ``--workers`` workers)
   against the same steps on synthetic inputs already on the GPU. Reports
   both images/s, their ratio (goal >= 0.9) and the CPU cores used.
4. **Horovod with NCCL** (:func:`horovod_nccl`): ``horovodrun --check-build``
   must list NCCL, then the demo for a few steps at ``horovodrun -np 1`` on
   the GPU.

Every part returns a dict; the script prints them and writes them as JSON to
``--out``. Parts that need a GPU report ``skipped`` without one. The CPU
tests (tests/benchmarks/test_gpu_acceptance.py) run part 1 against timm,
part 2 on the CPU in fp32 and bf16, part 3 with tiny sizes and part 4's
build check.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
PARITY_TOLERANCE = 1e-5
PIPELINE_GOAL = 0.9


def _exact_float32() -> None:
    """No TF32 in convolutions or matmuls: the parity check compares fp32 with fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _randomise_statistics(model: torch.nn.Module, seed: int = 0) -> None:
    """BatchNorm statistics away from (0, 1), so that a statistic loaded into the wrong layer shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("running_mean"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) * 0.2 - 0.1)
            elif name.endswith("running_var"):
                tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)


def _load(backbone: str, path: Path, device: torch.device, image_size: int) -> torch.nn.Module:
    from pksampler.train.config.load import load_config
    from pksampler.train.runtime.distributed import Backend
    from pksampler.train.modeling.model import build_model
    from pksampler.train.modeling.pretrained import load_pretrained

    config = load_config(None, [f"model.backbone={backbone}", "model.norm=batch", f"model.pretrained={path}"],
                         environ={})
    model = build_model(config.model, image_size=image_size)
    load_pretrained(model, str(path), Backend(), name=backbone)
    return model.to(device).eval()


def parity(reference: torch.nn.Module, workdir: Path, *, device: str = "cuda", image_size: int = 224,
           batch: int = 4, torchvision_too: bool = True) -> dict[str, Any]:
    """Part 1: ``reference`` (a ResNet-50 whose ``forward`` gives pooled features) against ours, same weights.

    ``reference``'s state dict is written to ``workdir`` and loaded through ``model.pretrained`` into ``resnet50`` (and
    ``torchvision:resnet50`` when ``torchvision_too``).
    """
    _exact_float32()
    target = torch.device(device)
    _randomise_statistics(reference)
    path = workdir / "resnet50_reference.pth"
    torch.save(reference.state_dict(), path)
    images = torch.randn(batch, 3, image_size, image_size, generator=torch.Generator().manual_seed(1)).to(target)
    reference = reference.to(target).eval()
    result: dict[str, Any] = {"device": str(target), "image_size": image_size, "batch": batch}
    with torch.no_grad():
        expected = reference(images)
        ours = _load("resnet50", path, target, image_size)
        result["resnet50_max_abs_diff"] = float((ours.pool(ours.backbone(images)) - expected).abs().max())
        if torchvision_too:
            wrapped = _load("torchvision:resnet50", path, target, image_size)
            result["torchvision_resnet50_max_abs_diff"] = float((wrapped.backbone(images) - expected).abs().max())
    differences = [v for k, v in result.items() if k.endswith("max_abs_diff")]
    result["passed"] = max(differences) <= PARITY_TOLERANCE
    return result


def torchvision_resnet50() -> torch.nn.Module:
    """torchvision's ResNet-50 (random weights) with the classifier replaced by the identity: pooled features."""
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    model.fc = torch.nn.Identity()
    return model


def demo_recall(workspace: Path, *, device: str, precision: str, overrides: Sequence[str] = (),
                timeout: float = 3600) -> dict[str, Any]:
    """One run of ``configs/demo.yaml`` under ``torchrun --nproc_per_node 1``; its held-out Recall@1."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--standalone",
               str(ROOT / "train" / "retrieval.py"), "--config", str(ROOT / "configs" / "demo.yaml"), "--no-resume"]
    for setting in (f"workspace={workspace}", f"train.device={device}", f"train.precision={precision}",
                    "train.tensorboard=false", *overrides):
        command += ["--set", setting]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        return {"device": device, "precision": precision, "error": (result.stdout + result.stderr)[-2000:]}
    metrics = json.loads((workspace / "final_metrics.json").read_text())
    announced = [line for line in result.stdout.splitlines() if "backend=" in line]
    return {"device": device, "precision": precision, "recall_at_1": metrics["recall_at_1"],
            "seconds": round(seconds, 1), "announced": announced[0] if announced else ""}


def demo_recalls(workdir: Path, *, gpu: str = "cuda", precisions: Sequence[str] = ("fp32", "bf16"),
                 tolerance: float = 0.02, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Part 2: the demo on the CPU (fp32, the reference) and on ``gpu`` in each precision; R@1 compared."""
    reference = demo_recall(workdir / "demo_cpu_fp32", device="cpu", precision="fp32", overrides=overrides)
    runs = [demo_recall(workdir / f"demo_{gpu}_{p}", device=gpu, precision=p, overrides=overrides)
            for p in precisions]
    result: dict[str, Any] = {"reference": reference, "runs": runs, "tolerance": tolerance}
    if "recall_at_1" not in reference or any("recall_at_1" not in run for run in runs):
        result["passed"] = False
        return result
    gaps = [abs(run["recall_at_1"] - reference["recall_at_1"]) for run in runs]
    result.update(max_gap=max(gaps), passed=max(gaps) <= tolerance)
    return result


def make_shards(workdir: Path, *, classes: int, per_class: int, side: int, workers: int = 2) -> Path:
    """JPEGs of the synthetic product renderer (``side`` px, quality 90), packed into shards; reused when present."""
    from PIL import Image

    from pksampler.datasets import render_product
    from pksampler.datasets.pack import pack
    from pksampler.files import atomic_write_bytes

    shards = workdir / f"shards_{classes}x{per_class}_{side}"
    if (shards / "manifest.json").is_file():
        return shards
    folder = workdir / f"images_{classes}x{per_class}_{side}"
    for cls in range(classes):
        for view in range(per_class):
            target = folder / f"class_{cls:05d}" / f"{view:03d}.jpg"
            if not target.is_file():
                image = render_product(cls, view, image_size=96).resize((side, side), Image.BICUBIC)
                stream = io.BytesIO()
                image.save(stream, format="JPEG", quality=90)
                atomic_write_bytes(target, stream.getvalue())
    pack(folder, shards, workers=workers)
    return shards


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _steps_per_second(batches: Callable[[], Any], step: Callable[[torch.Tensor, torch.Tensor], None], *,
                      steps: int, warmup: int, device: torch.device) -> float:
    """Training steps per second over ``steps`` batches after ``warmup`` (start-up and autotuning excluded)."""
    stream, done, started = batches(), 0, 0.0
    for images, labels in stream:
        if done == warmup:
            _sync(device)
            started = time.perf_counter()
        step(images, labels)
        done += 1
        if done == warmup + steps:
            break
    _sync(device)
    elapsed = time.perf_counter() - started
    if hasattr(stream, "close"):
        stream.close()  # a loader generator shuts its workers down
    if done < warmup + steps:
        raise ValueError(f"the data gave {done} batches, fewer than warmup + steps = {warmup + steps}")
    return steps / elapsed


def _trainer_parts(shards: Path, *, backbone: str, image_size: int, classes_per_step: int, samples_per_class: int,
                   workers: int, device: str, precision: str):
    """The trainer's own pieces for one rank: dataset, transforms, P x K sampler, model, loss, device set-up."""
    from pksampler.train.builders import build_data, build_sampler
    from pksampler.train.config.load import load_config
    from pksampler.train.runtime.device import setup_device
    from pksampler.train.losses.pair import build_loss
    from pksampler.train.modeling.model import build_model

    config = load_config(None, [
        "data.name=shards", "data.args={}", f"data.root={shards}", f"data.image_size={image_size}", f"data.workers={workers}",
        "data.test_fraction=0.01", f"sampler.classes_per_step={classes_per_step}",
        f"sampler.samples_per_class={samples_per_class}", f"model.backbone={backbone}", "model.norm=batch",
        f"train.device={device}", f"train.precision={precision}"], environ={})
    data = build_data(config)
    sampler = build_sampler(config.sampler, data.train.labels, 1, 0, config.seed)
    setup = setup_device(device, precision, 0)
    model = setup.prepare_model(build_model(config.model, image_size=image_size)).train()
    return data, sampler, model, build_loss("multi_similarity", {}).to(setup.device), setup


def pipeline_ratio(shards: Path, *, backbone: str = "resnet50", image_size: int = 224, classes_per_step: int = 64,
                   samples_per_class: int = 4, workers: int = 8, steps: int = 50, warmup: int = 10,
                   device: str = "cuda", precision: str = "bf16") -> dict[str, Any]:
    """Part 3: images/s of training steps fed by our loader from ``shards`` vs by inputs already on the device."""
    from pksampler.train.runtime.loader import TrainLoader

    data, sampler, model, loss_fn, setup = _trainer_parts(
        shards, backbone=backbone, image_size=image_size, classes_per_step=classes_per_step,
        samples_per_class=samples_per_class, workers=workers, device=device, precision=precision)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        with setup.autocast():
            embeddings = model(setup.to_device(images))
        loss_fn(embeddings.float(), labels.to(setup.device, non_blocking=True)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # As the trainer does: one loader, persistent workers shipping uint8, augmentation on the device.
    train_loader = TrainLoader(data.train, sampler, data.augment, workers=workers, setup=setup,
                               prefetch_factor=4 if workers else None)

    def loader():
        epoch = 0
        while True:  # one pass of the batch sampler per epoch
            sampler.set_epoch(epoch)
            data.train.set_epoch(epoch)
            yield from train_loader.epoch(epoch)
            epoch += 1

    batch = sampler.batch_size
    images = torch.randn(batch, 3, image_size, image_size).to(setup.device, memory_format=setup.memory_format)
    labels = (torch.arange(batch) // samples_per_class).to(setup.device)

    def synthetic():
        while True:
            yield images, labels

    synthetic_rate = batch * _steps_per_second(synthetic, step, steps=steps, warmup=warmup, device=setup.device)
    try:
        loader_rate = batch * _steps_per_second(loader, step, steps=steps, warmup=warmup, device=setup.device)
    finally:
        train_loader.close()
    ratio = loader_rate / synthetic_rate
    return {"backbone": backbone, "image_size": image_size, "batch": batch, "precision": setup.precision,
            "device": str(setup.device), "channels_last": setup.memory_format == torch.channels_last,
            "synthetic_images_per_s": synthetic_rate, "loader_images_per_s": loader_rate,
            "ratio": ratio, "goal": PIPELINE_GOAL, "passed": ratio >= PIPELINE_GOAL,
            "cpu_cores": len(os.sched_getaffinity(0)), "loader_workers": workers,
            "torch_threads": torch.get_num_threads()}


def check_build(horovodrun: Path) -> dict[str, dict[str, bool]]:
    """``horovodrun --check-build`` as {section: {name: available}} ("Available Tensor Operations": {"NCCL": ...})."""
    output = subprocess.run([str(horovodrun), "--check-build"], capture_output=True, text=True, timeout=300).stdout
    sections: dict[str, dict[str, bool]] = {}
    current = None
    for line in output.splitlines():
        text = line.strip()
        if text.endswith(":") and not text.startswith("["):
            current = sections.setdefault(text[:-1], {})
        elif current is not None and text.startswith(("[X]", "[ ]")):
            current[text[3:].strip()] = text.startswith("[X]")
    return sections


def horovod_nccl(workdir: Path, *, horovodrun: Path | None = None, steps: int = 20, device: str = "cuda",
                 build: dict[str, dict[str, bool]] | None = None) -> dict[str, Any]:
    """Part 4: Horovod built with NCCL, then the demo for ``steps`` steps at ``horovodrun -np 1`` on ``device``.

    ``build``: the output of :func:`check_build` when it was already read.
    """
    horovodrun = horovodrun or Path(sys.executable).with_name("horovodrun")
    build = build if build is not None else check_build(horovodrun)
    operations = build.get("Available Tensor Operations", {})
    result: dict[str, Any] = {"nccl": operations.get("NCCL", False), "gloo": operations.get("Gloo", False),
                              "pytorch": build.get("Available Frameworks", {}).get("PyTorch", False)}
    if not result["nccl"]:
        result.update(passed=False, note="Horovod was built without NCCL: run `PKSAMPLER_HOROVOD_GPU=nccl make setup` "
                                          "on the GPU machine (needs nvcc and a CUDA torch)")
        return result
    command = [str(horovodrun), "-np", "1", "-H", "localhost:1", sys.executable, str(ROOT / "train" / "retrieval.py"),
               "--no-resume", "--set", f"workspace={workdir / 'horovod_nccl'}", "--set", f"train.device={device}",
               "--set", f"train.max_steps={steps}", "--set", "train.tensorboard=false"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    announced = [line for line in run.stdout.splitlines() if "backend=" in line]
    result.update(returncode=run.returncode, announced=announced[0] if announced else "",
                  passed=run.returncode == 0 and "backend=horovod" in "".join(announced))
    if run.returncode:
        result["error"] = (run.stdout + run.stderr)[-2000:]
    return result


def _run_part(number: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    gpu = torch.cuda.is_available()
    if number != 1 and not gpu:
        return {"skipped": "no CUDA device visible"}
    if number == 1:
        try:
            reference = torchvision_resnet50()
        except Exception as error:  # noqa: BLE001 - torchvision missing or built for another torch
            return {"skipped": f"torchvision does not import here: {type(error).__name__}: {error}"}
        return parity(reference, workdir, device="cuda" if gpu else "cpu")
    if number == 2:
        return demo_recalls(workdir, tolerance=args.tolerance)
    if number == 3:
        shards = make_shards(workdir, classes=args.classes, per_class=args.per_class, side=args.side)
        return pipeline_ratio(shards, workers=args.workers, steps=args.steps)
    return horovod_nccl(workdir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="1,2,3,4", help="comma-separated part numbers (default: all)")
    parser.add_argument("--workdir", type=Path, default=None, help="kept between runs (shards are reused)")
    parser.add_argument("--out", type=Path, default=Path("gpu_acceptance.json"))
    parser.add_argument("--tolerance", type=float, default=0.02, help="part 2: allowed Recall@1 gap to the CPU run")
    parser.add_argument("--workers", type=int, default=max(1, min(8, len(os.sched_getaffinity(0)) - 2)),
                        help="part 3: DataLoader workers")
    parser.add_argument("--steps", type=int, default=50, help="part 3: timed steps per case")
    parser.add_argument("--classes", type=int, default=500, help="part 3: classes in the shards")
    parser.add_argument("--per-class", type=int, default=8, help="part 3: images per class")
    parser.add_argument("--side", type=int, default=400, help="part 3: JPEG side in pixels")
    args = parser.parse_args(argv)
    parts = sorted({int(p) for p in args.parts.split(",")})
    from pksampler.files import atomic_write_text

    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        results = {}
        for number in parts:
            print(f"[gpu_acceptance] part {number} ...", flush=True)
            results[f"part{number}"] = _run_part(number, args, workdir)
            print(json.dumps(results[f"part{number}"], indent=2), flush=True)
    results["machine"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                          "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                          "cpu_cores": len(os.sched_getaffinity(0))}
    atomic_write_text(args.out, json.dumps(results, indent=2))
    print(f"[gpu_acceptance] written to {args.out}")
    return 0 if all(r.get("passed", True) for r in results.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
