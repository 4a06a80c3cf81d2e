"""The run configuration's schema: frozen dataclasses whose fields carry their own rules.

This module answers "what is a valid config". Each field says, in its
metadata:

* ``rule``: what a value must be (see :mod:`pksampler.train.config.rules`);
  :func:`validate` walks the tree once and raises :class:`ConfigError`
  naming the dotted key, the value and the rule;
* ``resumable``: a resumed run may change it (it takes effect from the
  resumed step); every other key must match the checkpoint's config;
* ``local``: ranks may disagree on it (per-host resources); every other key
  must be the same on every rank.

:func:`resumable_keys` and :func:`local_keys` read those flags for the
checks in :mod:`pksampler.train.config.agreement`.
Choice lists are not typed here: they come from the registries that
implement them (data sources, samplers, norms, losses), so a new entry in a
registry is a new valid value.

The batch is configured globally: ``sampler.classes_per_step`` (G) classes
of ``sampler.samples_per_class`` (K) images per global step; each of the W
ranks takes P = G / W classes (ceil or floor of it when W does not divide
G). The same file trains the same global batches at every world size up to G.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pksampler.locations import is_remote
from pksampler.train.config import choices, rules
from pksampler.train.errors import ConfigError

__all__ = [
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "HeadConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SamplerConfig",
    "TrainConfig",
    "local_keys",
    "resolve_head_defaults",
    "resumable_keys",
    "validate",
]


def _rule(default: Any, rule: rules.Rule | None, *, resumable: bool = False, local: bool = False) -> Any:
    """A field with its rule and its resume/agreement flags (see the module docstring)."""
    metadata = {"rule": rule, "resumable": resumable, "local": local}
    if callable(default) and not isinstance(default, (int, float, str, bool)):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DataConfig:
    """Where the images come from and how they are split and augmented.

    ``name``: ``synthetic`` (built-in SyntheticProducts, rendered in memory;
    ``args`` are its arguments), ``folder`` (ImageFolderDataset under
    ``root``), ``list`` (ListFileDataset; ``args.list_file`` relative to
    ``root``) or ``shards`` (ShardedDataset: packed tar shards under ``root``,
    or ``s3://bucket/prefix``). The ``data.args.*`` rows list each source's
    arguments; ``decode_size`` defaults to ``image_size`` here.

    ``datasets``: several datasets under ``root`` trained as one union (the
    ``DATASETS`` variable with commas sets it): each entry is a name, or
    ``name:folder|list|shards`` where detection should not decide; classes are
    ``<name>/<class>``, never merged across datasets; ``args`` go to the
    entries of ``name``'s layout. A resume must keep the list.
    """

    name: str = _rule("synthetic", rules.choice(lambda: _registry("data")))
    args: Mapping[str, Any] = field(default_factory=lambda: {"num_classes": 160, "images_per_class": 16, "image_size": 48})
    root: str | None = _rule(None, None, resumable=True)
    # several datasets under root, trained as their union (`DATASETS=a,b` sets it); classes are `<name>/<class>`
    datasets: tuple[str, ...] = _rule((), rules.dataset_names)
    test_fraction: float = _rule(0.3, rules.open_interval(0.0, 1.0))
    image_size: int = _rule(40, rules.positive_int)
    workers: int = _rule(1, rules.int_at_least(0), resumable=True, local=True)
    split_seed: int = _rule(0, rules.seed)
    # index: the test classes are a permutation of the class codes (another set on a grown label set); name: each
    # class's side is keyed by its name, so it keeps it when classes come and go (docs/growing.md)
    split_by: str = _rule("index", rules.choice(lambda: ("index", "name")))
    # images of every training class kept out of training: the image-level evaluation's queries (0: none)
    heldout_images: int = _rule(0, rules.int_at_least(0))
    max_bad_fraction: float = _rule(0.001, rules.closed_interval(0.0, 1.0), resumable=True)
    # training augmentation strengths (BatchAugment): scale [0.6, 1], ratio [3/4, 4/3], flip 0.5, jitter 0.3,
    # rotation 0 unless given; e.g. {flip: 0} for text and characters, whose mirror image is another glyph
    augment: Mapping[str, Any] = _rule(dict, rules.augment)


@dataclass(frozen=True)
class SamplerConfig:
    """The global composition of a step.

    ``balanced``: ``classes_per_step`` (G, over all ranks) × ``samples_per_class``
    (K); ``args`` are the other keyword arguments of
    DistributedBalancedBatchSampler (``small_classes``, ``class_weighting``,
    ``locality``, ``window``). ``triplet``: ``triplets_per_step`` (over all
    ranks); ``args``: ``negatives``, ``hard_classes``, ``hard_fraction``. The
    ``sampler.args.*`` rows list them with their defaults.
    """

    name: str = _rule("balanced", rules.choice(lambda: _registry("sampler")))
    classes_per_step: int = _rule(16, rules.positive_int)
    samples_per_class: int = _rule(4, rules.positive_int)
    triplets_per_step: int = _rule(24, rules.positive_int)
    args: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    """A backbone with an L2-normalised embedding head (``pksampler.train.modeling.model``).

    ``backbone``: ``resnet`` (the compact demo network; ``width`` and
    ``depth`` and ``stem_stride`` apply to it alone), ``resnet18/34/50/101`` (torchvision's
    names), ``vit_small_patch16`` / ``vit_base_patch16`` (timm's names) or
    ``torchvision:<name>``. ``pretrained``: a ``.pth`` or ``.safetensors``
    file of backbone weights. ``norm``: ``auto`` (the backbone's own), ``group``,
    ``batch``, ``sync_batch`` or ``none``. ``freeze_norm``: the backbone's BatchNorm
    statistics and affine parameters stay as loaded (null: when ``pretrained`` is given). ``freeze_backbone_steps``:
    the backbone is not updated for the first N optimizer steps.
    """

    backbone: str = _rule("resnet", rules.choice(lambda: _registry("backbone"), prefixes=("torchvision:",)))
    width: int = _rule(32, rules.positive_int)
    depth: tuple[int, ...] = _rule((1, 1, 1, 1), rules.positive_int_list)
    # the demo network's first convolution: 1 keeps full resolution, 2 halves it (a quarter of the cost
    # per pixel, so larger images for the same compute)
    stem_stride: int = _rule(1, rules.int_between(1, 4))
    embedding_dim: int = _rule(64, rules.positive_int)
    # auto: the backbone's own (BatchNorm for the ResNets, group norm for the demo network, LayerNorm inside a ViT)
    norm: str = _rule("auto", rules.choice(lambda: _registry("norm")))
    pooling: str = _rule("avg", rules.choice(lambda: _registry("pooling")))  # avg | gem | avgmax
    neck: str = _rule("none", rules.choice(lambda: _registry("neck")))  # none | batch (global batch) | layer, before L2
    # the projection from the pooled feature to the embedding has a bias; null: none when head.name is set
    # (a bias is a component every embedding shares, which a classification head can collapse them onto)
    projection_bias: bool | None = _rule(None, rules.optional(rules.boolean))
    # LayerNorm without affine on the pooled feature, before the projection (Zhai & Wu 2018): removes the component
    # every image's pooled ReLU feature shares; per image, so the same at every world size and chunk size
    pool_norm: bool = _rule(False, rules.boolean)
    pretrained: str | None = _rule(None, rules.optional(rules.non_empty_string), resumable=True)  # read on a fresh start only
    # null: frozen exactly when `pretrained` is given and the backbone has BatchNorm (detectron2's default)
    freeze_norm: bool | None = _rule(None, rules.optional(rules.boolean))
    freeze_backbone_steps: int = _rule(0, rules.int_at_least(0))


@dataclass(frozen=True)
class LossConfig:
    """A built-in loss (``batch_hard``, ``multi_similarity``, ``contrastive``,
    ``triplet``) or a pytorch-metric-learning one (``pml.<LossName>``), with
    ``args``; ``miner`` (``{name: pml.<MinerName>, args: {}}``) and
    ``memory`` (cross-batch memory: ``{size, warmup_steps}``) are optional.
    ``weight`` weighs the pair loss against the head's (``head:``); 0 trains
    the head alone. Without a head it stays 1."""

    name: str = _rule("multi_similarity", rules.choice(lambda: _registry("loss"), prefixes=("pml.",)))
    args: Mapping[str, Any] = field(default_factory=dict)
    miner: Mapping[str, Any] | None = None
    memory: Mapping[str, Any] | None = _rule(None, rules.optional(rules.memory))
    weight: float = _rule(1.0, rules.non_negative_finite)  # the pair loss's weight; 0: the head alone


#: head.scale's bound: the head's softmax offsets logits by the scale in fp64, so a row whose logits all lie near
#: −scale sums terms of exp(−2·scale), which stay above fp64's smallest (exp(−708)) up to here (insightface: 64)
MAX_HEAD_SCALE = 300.0


@dataclass(frozen=True)
class HeadConfig:
    """A margin-softmax classification head beside the pair loss, its rows sharded over the ranks.

    ``name``: null (no head), ``arcface`` (cos(θ + m)), ``cosface`` (cos θ − m)
    or ``softmax`` (normalised softmax, no margin). Each step samples its
    positives and about ``negatives`` other classes by a hash of (seed, step,
    class), the same at every world size; the total loss is ``loss.weight`` × the pair loss +
    ``weight`` × the head's; ``bnneck`` puts a batch normalisation (zero
    frozen bias) between the pair loss's embeddings and the head's.

    The recipe of the sources (insightface Partial FC, Zhai & Wu 2018, AdaCos):
    rows start small (N(0, 0.01²) a coordinate) and are normalised only in the
    forward pass; they learn by their own row-sparse SGD, ``lr`` (for
    ``optim.base_batch`` images, scaled linearly with the global batch, on the
    run's warm-up and cosine schedule) with ``momentum`` and decoupled
    ``weight_decay``, not at AdamW's rate; ``scale`` null is √2·ln(C − 1)
    bounded to [10, 64]; the margin is 0 for ``softmax_steps`` steps, then
    ramps linearly to ``margin`` over ``margin_ramp_steps``.
    """

    name: str | None = _rule(None, rules.optional(rules.choice(lambda: _registry("head"))))
    # logits are scale·cos; null: AdaCos's √2·ln(C − 1) bounded to [10, 64]; above 300 a row of the fp64 softmax
    # can underflow to log(0) (insightface uses 64)
    scale: float | None = _rule(None, rules.optional(rules.left_open_interval(0.0, MAX_HEAD_SCALE)))
    margin: float = _rule(0.3, rules.closed_interval(0.0, 1.5))
    # global steps of plain normalised softmax (margin 0), then a linear ramp to `margin` (insightface #214)
    softmax_steps: int = _rule(100, rules.int_at_least(0))
    margin_ramp_steps: int = _rule(200, rules.int_at_least(0))
    # expected sampled negative classes per step (every class when >= the number of classes)
    negatives: int = _rule(8192, rules.positive_int)
    subcentres: int = _rule(1, rules.int_between(1, 16))  # sub-centre ArcFace: k centres per class, the nearest used
    # the head's loss against the pair loss in the network's gradient; the rows step on the head's loss alone
    # (the weight divided out), so a small weight does not slow them down
    weight: float = _rule(1.0, rules.positive_finite)
    # the rows' own SGD: rate for optim.base_batch images (linear in the global batch, on the run's schedule)
    lr: float = _rule(0.1, rules.positive_finite)
    # below 1: a momentum of 1 never forgets a gradient, so the step grows without bound
    momentum: float = _rule(0.9, rules.right_open_interval(0.0, 1.0))
    weight_decay: float = _rule(0.0005, rules.non_negative_finite)  # decoupled, applied lazily and exactly
    # BNNeck (BoT): the head reads the embeddings batch-normalised over the gathered global batch (the same at
    # every world size); the pair loss and retrieval read them before it. null: on (the head recipe)
    bnneck: bool | None = _rule(None, rules.optional(rules.boolean))


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, SGD, LAMB or LARS. ``lr`` is for ``base_batch`` images per global
    step; ``scaling`` moves it to the global batch: ``linear`` (lr x batch /
    base_batch, Goyal et al., for SGD and LARS), ``sqrt`` (lr x sqrt(batch /
    base_batch), Malladi et al., for AdamW and LAMB), ``none`` (lr as given),
    ``auto`` (the optimizer's own rule). A linear warm-up of ``warmup_steps``
    steps, or of ``warmup_fraction`` of the run when that is set, then cosine
    decay. ``backbone_lr_scale``: the backbone's parameters learn at ``lr *
    backbone_lr_scale`` (the head at ``lr``). ``clip_grad_norm``: the reduced
    gradients' global norm is clipped to it before the step (Horovod: after
    ``synchronize()``)."""

    name: str = _rule("adamw", rules.choice(lambda: _registry("optimizer")))
    lr: float = _rule(0.004, rules.positive_finite)
    base_batch: int = _rule(64, rules.positive_int)
    weight_decay: float = _rule(0.0005, rules.non_negative_finite)  # sgd, adamw: x the peak rate below 1; below float32's largest
    momentum: float = _rule(0.9, rules.right_open_interval(0.0, 1.0))  # SGD, LARS; below 1 (1 never forgets)
    warmup_steps: int = _rule(30, rules.int_at_least(0))
    # the warm-up as a share of the run's steps (Goyal et al.: 5 of 90 epochs); set, it replaces warmup_steps
    warmup_fraction: float | None = _rule(None, rules.optional(rules.closed_interval(0.0, 1.0)))
    # how lr follows the global batch from base_batch: auto (the optimizer's rule) | linear | sqrt | none
    scaling: str = _rule("auto", rules.choice(lambda: _registry("lr_scaling")))
    backbone_lr_scale: float = _rule(1.0, rules.non_negative_finite)  # backbone group at lr * scale
    # the dense gradients' global L2 norm is clipped to this after the allreduce (insightface: 5); null: no clip
    clip_grad_norm: float | None = _rule(None, rules.optional(rules.positive_finite))


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = _rule(8, rules.positive_int, resumable=True)
    # The run's length in global steps instead of epochs: epochs = round(steps / steps per epoch), at least
    # one, so a file costs about the same on any dataset size. Setting train.epochs (--set, EPOCHS) clears it.
    steps: int | None = _rule(None, rules.optional(rules.positive_int), resumable=True)
    device: str = _rule("auto", rules.choice(lambda: ("auto", "cpu", "cuda")), resumable=True)
    precision: str = _rule("auto", rules.choice(lambda: ("auto", "fp32", "bf16", "fp16")), resumable=True)
    gather_embeddings: bool = True
    fp16_allreduce: bool = False
    backward_passes_per_step: int = _rule(1, rules.positive_int)
    # Gradient-cached steps (train/engine/cached_step.py): images per forward pass on a rank; the loss still
    # sees the whole global batch and the gradients are exact. null: one forward over the rank's batch.
    chunk_size: int | None = _rule(None, rules.optional(rules.positive_int))
    eval_every: int = _rule(2, rules.positive_int, resumable=True)
    checkpoint_every: int = _rule(50, rules.int_at_least(0), resumable=True)
    resume: bool = _rule(True, None, resumable=True)
    threads: int = _rule(1, rules.int_between(1, 4096), resumable=True, local=True)
    max_steps: int | None = _rule(None, rules.optional(rules.int_at_least(0)), resumable=True)
    gallery_queries: int = _rule(8, rules.positive_int, resumable=True)
    progress_every_seconds: float = _rule(30.0, rules.positive_finite, resumable=True)
    tensorboard: bool | None = _rule(None, None, resumable=True)  # None: on when the tensorboard package is installed
    # torchrun: seconds a collective waits for the other ranks before the job ends naming the rank that
    # stopped; longer than anything rank 0 does alone (a checkpoint write, the result gallery): the held-out
    # search runs on every rank at once (docs/evaluation.md)
    collective_timeout: float = _rule(300.0, rules.closed_interval(1.0, 7 * 86400.0), resumable=True)
    # Bit-for-bit repeatable runs under both launchers, on any split of the ranks over hosts
    # (Horovod tensor fusion off, deterministic torch kernels; see train/runtime/device.py).
    deterministic: bool = _rule(False, rules.boolean, resumable=True)
    # Horovod elastic: in-memory commit every N global steps and at every checkpoint (train/engine/elastic/commit.py)
    commit_every: int = _rule(10, rules.positive_int, resumable=True)
    # A new run from a previous run's checkpoint on today's classes (not a resume): model and neck kept, the
    # head's rows matched by class name, a new class's row imprinted (or random); read on a fresh start only
    # (train/engine/continuation.py, docs/growing.md)
    init_from: str | None = _rule(None, rules.optional(rules.non_empty_string), resumable=True)
    # train.init_from's new classes: imprint (the normalised mean embedding of their training images, Qi et al.
    # 2018) or random (the head's initial draw)
    init_rows: str = _rule("imprint", rules.choice(lambda: ("imprint", "random")), resumable=True)


@dataclass(frozen=True)
class EvalConfig:
    """The held-out evaluation (train/evaluation/sharded.py): the gallery stays whole and spread over the ranks.

    Every held-out item is a query up to ``queries`` of them; above it a
    fixed class-stratified sample of that size, the same at every world size
    and every evaluation. Recall@1 is reported with its standard error.
    """

    # most queries per evaluation (all held-out items up to this; a sample above it)
    queries: int = _rule(100_000, rules.positive_int, resumable=True)
    # flat: exact search, the same metrics at every world size; ivf: approximate (IVF searched list by list),
    # for a self-gallery of 10^6 items and more, with its gap to exact search on check_queries sampled queries
    index: str = _rule("flat", rules.choice(lambda: ("flat", "ivf")), resumable=True)
    nprobe: int = _rule(16, rules.positive_int, resumable=True)  # ivf: lists probed per query
    check_queries: int = _rule(2000, rules.positive_int, resumable=True)  # ivf: queries also searched exactly


#: the values of ``distributed.horovod_wait`` (train/runtime/horovod_wait.py)
HOROVOD_WAITS = ("auto", "sleep", "spin")


@dataclass(frozen=True)
class DistributedConfig:
    backend: str = _rule("auto", rules.choice(lambda: ("auto", "horovod", "torch", "none")), resumable=True)
    # Horovod: how a rank waits for a collective. sleep: polls with sleeps of 20 us doubling to 1 ms, leaving the
    # core to the rank it waits for and to loader workers; spin: Horovod's own wait, a busy loop; auto: sleep on
    # CPU-only runs, spin on GPUs (docs/trainer.md, "Waiting for a collective")
    horovod_wait: str = _rule("auto", rules.choice(lambda: HOROVOD_WAITS), resumable=True)


@dataclass(frozen=True)
class RunConfig:
    seed: int = _rule(0, rules.seed)
    workspace: str = _rule("workspace/demo", None, resumable=True)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, Any]:
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _registry(kind: str) -> tuple[str, ...]:
    """Valid names for ``kind``, given by the layer that implements them (:mod:`.choices`)."""
    return choices.names(kind)


def validate(config: Any, prefix: str = "") -> None:
    """Apply every field's rule, depth first; raise ConfigError naming the first bad key."""
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        path = f"{prefix}.{spec.name}" if prefix else spec.name
        if dataclasses.is_dataclass(value):
            validate(value, path)
            continue
        rule = spec.metadata.get("rule")
        if rule is not None:
            rule(path, value)
    if prefix == "":
        _validate_combinations(config)


def _validate_combinations(config: RunConfig) -> None:
    """Rules that relate two keys."""
    sampler, loss = config.sampler, config.loss
    if config.data.root and not is_remote(config.data.root):
        root, workspace = Path(config.data.root).resolve(), Path(config.workspace).resolve()
        if workspace == root or root in workspace.parents:
            raise ConfigError(f"workspace: {config.workspace} lies inside data.root {config.data.root}; the data "
                              "location is read-only (a scan would also see the run's own files): choose another WORKSPACE")
    _check_effective_lr(config)
    _check_head(config)
    if sampler.name == "triplet" and loss.name != "triplet":
        raise ConfigError(f"loss.name: the triplet sampler needs loss 'triplet', got {loss.name!r}")
    if sampler.name == "balanced" and loss.name == "triplet":
        raise ConfigError("loss.name: 'triplet' needs sampler.name 'triplet'")
    for key in ("classes_per_batch", "num_replicas", "rank", "seed", "samples_per_class", "triplets_per_batch"):
        if key in sampler.args:
            raise ConfigError(
                f"sampler.args.{key}: set by the trainer; the batch is configured globally with "
                "sampler.classes_per_step (G) and sampler.samples_per_class (K), or sampler.triplets_per_step, "
                "and each rank takes G / world_size classes"
            )


def _check_head(config: RunConfig) -> None:
    """The head's rules that relate two keys: ``loss.weight`` needs a head, a head one backward pass a step."""
    if config.loss.weight != 1 and config.head.name is None:
        raise ConfigError(f"loss.weight: {config.loss.weight!r} weighs the pair loss against the head's, and there is "
                          "no head (head.name: null): leave it at 1, or set head.name (arcface, cosface, softmax)")
    if config.head.name is not None and config.train.backward_passes_per_step != 1:
        raise ConfigError("head.name: a sharded head needs train.backward_passes_per_step: 1 (use train.chunk_size "
                          f"for batches larger than memory), got {config.train.backward_passes_per_step}")
    if config.head.name is not None:
        sampler = config.sampler
        images = 3 * sampler.triplets_per_step if sampler.name == "triplet" else \
            sampler.classes_per_step * sampler.samples_per_class
        rate = config.head.lr * images / config.optim.base_batch  # the rows' peak rate (HeadedLoss.from_config)
        if rate * config.head.weight_decay >= 1:
            raise ConfigError(f"head.weight_decay: {config.head.weight_decay!r} times the rows' rate {rate:g} (head.lr "
                              f"{config.head.lr!r} × {images} images / optim.base_batch {config.optim.base_batch}) "
                              "must be below 1: each step scales a row by 1 − rate × decay, which would zero or flip it")


def resolve_head_defaults(config: RunConfig) -> RunConfig:
    """The values that depend on whether a head is on, filled in: with ``head.name`` set (the head recipe),
    ``model.projection_bias`` null is false and ``head.bnneck`` null true; without a head, their values of every
    run before the keys became null (a bias, no neck)."""
    model, head = config.model, config.head
    if model.projection_bias is None:
        model = dataclasses.replace(model, projection_bias=head.name is None)
    if head.bnneck is None:
        head = dataclasses.replace(head, bnneck=head.name is not None)
    if model is config.model and head is config.head:
        return config
    return dataclasses.replace(config, model=model, head=head)


def _flagged(config: Any, flag: str, prefix: str = "") -> frozenset[str]:
    keys: set[str] = set()
    for spec in dataclasses.fields(config):
        path = f"{prefix}.{spec.name}" if prefix else spec.name
        value = getattr(config, spec.name)
        if dataclasses.is_dataclass(value):
            keys |= _flagged(value, flag, path)
        elif spec.metadata.get(flag, False):
            keys.add(path)
    return frozenset(keys)


def resumable_keys() -> frozenset[str]:
    """Dotted keys a resumed run may change (fields marked ``resumable``)."""
    return _flagged(RunConfig(), "resumable")


def local_keys() -> frozenset[str]:
    """Dotted keys ranks may disagree on (fields marked ``local``); all others must agree."""
    return _flagged(RunConfig(), "local")


def _check_effective_lr(config: RunConfig) -> None:
    """The rate the optimizer gets, ``optim.lr`` moved to the images per step by ``optim.scaling``, must be finite."""
    sampler = config.sampler
    images = 3 * sampler.triplets_per_step if sampler.name == "triplet" else sampler.classes_per_step * sampler.samples_per_class
    try:
        choices.check("effective_lr", (config.optim, images))  # the rule per optimizer is the solver's
    except ValueError as error:
        raise ConfigError(str(error)) from None
