"""Embed a catalogue across ranks into ``.npy`` parts (:mod:`.parts`), resumable, the same at every world size.

The input pipeline is the trainer's evaluation path (:func:`~pksampler.train.evaluation.heldout.embed`):
DataLoader workers decode and ship uint8 squares (``ToUint8``), the rank's
device crops and normalises (``CenterView``) and runs the model under the
rank's autocast. What differs is where the result goes: each rank keeps
its own parts and writes them, nothing is gathered.

Bad images (missing, truncated, not an image) are named on stderr by the rank
that met them, left out of their part (their ids are missing from
``ids/``) and counted in the part's record and the manifest; more than
``max_bad_fraction`` of the catalogue is an error.

A folder that already holds a finished catalogue grows by a version
(:mod:`.versions`): the ranks fingerprint the source's items (each rank a
stride of them), and only the new and changed items are embedded, under
new ids, into ``versions/000v/``; items that left are recorded as removed.
A checkpoint whose digest differs from the catalogue's is refused: a new
model means a new catalogue and a new index.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pksampler.agree import Outcomes, gather_outcomes
from pksampler.datasets import ImageLoadError
from pksampler.datasets.base import LabelledDataset
from pksampler.files import LockFileError, lock_exclusively
from pksampler.locations import is_remote

from pksampler.train.catalogue.model import LoadedModel, check_finite, load_model
from pksampler.train.catalogue.parts import (JOB_LOCK, MANIFEST, PartPlan, check_existing_parts, check_parts, finished,
                                             make_out_folder, read_manifest, read_record, version_folder,
                                             write_manifest, write_part)
from pksampler.train.catalogue.sources import (item_fingerprints, item_names, open_source, source_fingerprint,
                                               source_kind)
from pksampler.train.catalogue.versions import ITEMS, VersionPlan, plan_version, write_items
from pksampler.train.errors import ConfigError, SharedConfigError
from pksampler.train.runtime.distributed import Backend
from pksampler.train.runtime.loader import to_model_input, worker_context

__all__ = ["EmbedOptions", "embed_catalogue"]

#: what ``--device`` and ``--precision`` accept (the trainer's ``train.device`` and ``train.precision``)
DEVICES, PRECISIONS = ("auto", "cpu", "cuda"), ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class EmbedOptions:
    """How a catalogue is embedded: part size, batch size, workers per rank, progress cadence, bad-image limit,
    device and precision, and how long an object store may fail before the job stops."""

    part_size: int = 65536
    batch_size: int = 128
    workers: int = 2
    progress_every: float = 10.0
    max_bad_fraction: float = 0.01
    device: str = "auto"
    precision: str = "auto"
    outage_seconds: float = 60.0

    def __post_init__(self) -> None:
        for name, value in (("batch_size", self.batch_size), ("part_size", self.part_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')}: must be a positive int, got {value!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 0:
            raise ConfigError(f"--workers: must be an int >= 0, got {self.workers!r}")
        if not 0.0 <= self.max_bad_fraction <= 1.0:
            raise ConfigError(f"--max-bad-fraction: must lie in [0, 1], got {self.max_bad_fraction!r}")
        for name, value, allowed in (("device", self.device, DEVICES), ("precision", self.precision, PRECISIONS)):
            if value not in allowed:
                raise ConfigError(f"--{name}: {value!r} must be one of {list(allowed)}")
        if not 0.0 < self.outage_seconds <= 7 * 24 * 3600:
            raise ConfigError(f"--outage-seconds: must lie in (0, 604800], got {self.outage_seconds!r}")


class _SkipBad(Dataset):
    """Item ``i`` as ``(uint8 image, ok)``; an unreadable one is named on stderr and comes back blank, ``ok`` False."""

    def __init__(self, dataset: LabelledDataset, side: int) -> None:
        self.dataset, self.side = dataset, side

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, bool]:
        try:
            return self.dataset[index][0], True
        except ImageLoadError as error:
            print(f"pksampler: catalogue image {index} skipped: {error}", file=sys.stderr, flush=True)
            return torch.zeros(3, self.side, self.side, dtype=torch.uint8), False


def _batches(plan: PartPlan, parts: list[int], batch_size: int) -> list[list[int]]:
    """Every batch of ``parts`` (the source's item numbers) in order; a batch never crosses a part (so a part's
    batches are fixed)."""
    batches = []
    for part in parts:
        items = plan.items(part).tolist()
        batches += [items[s:s + batch_size] for s in range(0, len(items), batch_size)]
    return batches


class _Progress:
    """Rank 0's progress lines, every ``every`` seconds and at its last part: parts, images, images per second."""

    def __init__(self, rank: int, world: int, todo: int, every: float) -> None:
        self.rank, self.world, self.todo, self.every = rank, world, todo, every
        self.start = self.last = time.monotonic()
        self.parts = self.images = self.bad = 0

    def batch_done(self, images: int, *, bad: int = 0, part_finished: bool = False) -> None:
        self.images, self.bad = self.images + images, self.bad + bad
        self.parts += int(part_finished)
        now = time.monotonic()
        if self.rank == 0 and (now - self.last >= self.every or (part_finished and self.parts == self.todo)):
            self.last = now
            rate = self.images / max(now - self.start, 1e-9)
            overall = f" (about {rate * self.world:.0f} img/s over {self.world} ranks)" if self.world > 1 else ""
            print(f"[pksampler] embed: rank 0 finished {self.parts}/{self.todo} of its parts, {self.images} images, "
                  f"{rate:.0f} img/s{overall}, {self.bad} bad", flush=True)


def _write(out: Path, model: LoadedModel, plan: PartPlan, part: int, pending: dict[str, list], backend: Backend, *,
           seconds: float) -> None:
    """A finished part's readable rows, their ids and its record (bad ids, counts, model digest)."""
    start, stop = plan.bounds(part)
    keep = np.concatenate(pending["ok"])
    embeddings = np.concatenate(pending["emb"])[keep]
    check_finite(embeddings, f"part {part} (ids {start}..{stop - 1})")
    ids = plan.ids(part)
    write_part(out, part, embeddings, ids[keep], {
        "first": int(ids[0]), "stop": int(ids[-1]) + 1, "count": int(keep.sum()), "bad": ids[~keep].tolist(),
        "model_digest": model.digest, "part_size": plan.part_size, "total": plan.total,
        "source_digest": plan.source, "first_id": plan.first_id,
        "dim": int(embeddings.shape[1]), "seconds": round(seconds, 3), "rank": backend.rank,
        "world_size": backend.size})


def _embed_parts(model: LoadedModel, network: torch.nn.Module, dataset: LabelledDataset, plan: PartPlan,
                 parts: list[int], out: Path, backend: Backend, options: EmbedOptions) -> tuple[int, float]:
    """Embed and write ``parts``; returns (images embedded, seconds)."""
    setup, view = backend.setup, model.serving().view
    items = _SkipBad(dataset, model.input_size)
    loader = DataLoader(items, batch_sampler=_batches(plan, parts, options.batch_size), num_workers=options.workers,
                        pin_memory=setup.pin_memory, multiprocessing_context=worker_context(dataset, options.workers))
    progress = _Progress(backend.rank, backend.size, len(parts), options.progress_every)
    pending: dict[str, list] = {"emb": [], "ok": []}
    remaining = iter(parts)
    part, (start, stop) = None, (0, 0)
    started = time.monotonic()
    with torch.no_grad():
        for images, ok in loader:
            if part is None:
                part = next(remaining)
                start, stop = plan.bounds(part)
                part_started = time.monotonic()
            with setup.autocast():
                pending["emb"].append(network(to_model_input(images, setup, view)).float().cpu().numpy())
            pending["ok"].append(ok.numpy())
            if sum(len(o) for o in pending["ok"]) < stop - start:
                progress.batch_done(len(ok), bad=int((~ok).sum()))
            else:
                _write(out, model, plan, part, pending, backend, seconds=time.monotonic() - part_started)
                progress.batch_done(len(ok), bad=int((~ok).sum()), part_finished=True)
                pending, part = {"emb": [], "ok": []}, None
    return progress.images, time.monotonic() - started


def _setup_outcome(outcomes: Outcomes, rank: int, error: ConfigError | None) -> ConfigError | None:
    """The error ``rank`` raises once every rank's set-up outcome is known; None when every rank is ready.

    A rank that failed raises its own error. Its line is shown by the rank
    itself unless rank 0 or a lower rank failed with the same message (an
    error every rank hits is shown once, by rank 0: a :class:`SharedConfigError`).
    A rank that did not fail raises "stopped: rank(s) ... hit bad input", shown
    by rank 0 only.
    """
    failed = outcomes.failed
    if not failed:
        return None
    if error is None:
        return SharedConfigError(f"stopped: rank(s) {failed} hit bad input (named above by the rank(s)); nothing was "
                                 "embedded")
    if rank != 0 and outcomes.messages[rank] in outcomes.messages[:rank]:
        shared = SharedConfigError(str(error))
        shared.__cause__ = error
        return shared
    return error


def _agree_on_setup(backend: Backend, error: ConfigError | None) -> None:
    """Every rank learns whether any rank's set-up failed, so no rank waits in a collective for one that stopped."""
    outcome = _setup_outcome(gather_outcomes(backend, error), backend.rank, error)
    if outcome is not None:
        raise outcome


def _check_ranks_agree(backend: Backend, model: LoadedModel, plan: PartPlan, data: str, out: Path) -> None:
    """Every rank embeds the same model, catalogue and cut into the same folder, or every rank raises."""
    if backend.size == 1:
        return
    text = f"{model.digest}|{plan.total}|{plan.part_size}|{plan.first_id}|{plan.source}|{data}|{out.resolve()}"
    rows = gather_outcomes(backend, None, np.frombuffer(hashlib.sha256(text.encode()).digest()[:16], np.int64)).values
    if not (rows == rows[0]).all():
        differing = sorted({r for r in range(len(rows)) if not (rows[r] == rows[0]).all()})
        raise SharedConfigError(  # every rank raises it: rank 0 shows it once
            f"--checkpoint/--data/--out/--part-size: rank(s) {differing} were given another model, catalogue, part "
            f"size or output folder than rank 0 (this rank: {plan.total} images at {data}, parts of "
            f"{plan.part_size}, model {model.digest[:12]}, {out}); start every rank with the same arguments")


def _hold_out_folder(out: Path, model: LoadedModel, rank: int) -> Any:
    """Rank 0 locks ``out`` for the job (``flock``, released when the process ends), or one line naming the job that
    holds it: two jobs embedding into one folder would leave whichever parts finished last."""
    if rank != 0:
        return None
    try:
        handle, holder = lock_exclusively(out / JOB_LOCK, f"model {model.digest[:12]}, pid {os.getpid()} on "
                                                          f"{socket.gethostname()}")
    except LockFileError as error:
        raise ConfigError(f"--out: {error}") from None
    if handle is None:
        raise ConfigError(f"--out: {out} is being embedded by another job ({holder}); wait for it, or use another "
                          "--out")
    return handle


def _existing_manifest(out: Path, model: LoadedModel, data: str) -> dict[str, Any] | None:
    """The finished catalogue in ``out`` (None if none), refused when another model embedded it or when it is the
    catalogue of another source (a catalogue grows from the source it was embedded from)."""
    if not (out / MANIFEST).exists():
        return None
    try:
        manifest = read_manifest(out)
    except ConfigError as error:
        raise ConfigError(f"--out: {error}; use another --out (this one holds something else)") from None
    theirs = manifest["model"]["digest"]
    if theirs != model.digest:
        raise ConfigError(f"--checkpoint: {out} holds parts embedded by another model (digest {theirs[:12]}, "
                          f"this checkpoint's {model.digest[:12]}); a new model means a new catalogue and a new "
                          "index: use another --out")
    location = data if is_remote(data) else str(Path(data).resolve())
    if manifest["source"].get("location") != location:
        raise ConfigError(f"--out/--data: {out} holds parts embedded from another data source "
                          f"({manifest['source'].get('location')}, this --data is {location}); a catalogue grows from "
                          "the source it was embedded from: use that --data, or another --out")
    return manifest


def embed_catalogue(checkpoint: str | Path, data: str, out: str | Path, backend: Backend, *,
                    options: EmbedOptions = EmbedOptions()) -> dict[str, Any] | None:
    """Embed every image at ``data`` with the model of ``checkpoint`` into parts under ``out``; when ``out`` holds
    a finished catalogue, embed only what is new or changed since, as its next version.

    Runs on every rank of ``backend`` (one process, horovodrun or torchrun);
    returns the manifest on rank 0 (None elsewhere). Finished parts of an
    earlier run of the same model and plan are skipped; a job still running
    in ``out`` is refused.
    """
    out, lock = Path(out), None
    try:  # what each rank checks on its own (its files, its host): agreed on before any collective of the work
        model = load_model(checkpoint)
        make_out_folder(out)
        lock = _hold_out_folder(out, model, backend.rank)
        existing = _existing_manifest(out, model, data)
        dataset = open_source(data, decode_size=model.input_size, outage_seconds=options.outage_seconds)
        dataset.transform = model.worker_transform()
        listing = PartPlan(len(dataset), options.part_size, source_fingerprint(dataset))
    except ConfigError as error:
        if lock is not None:
            lock.close()
        _agree_on_setup(backend, error)
        raise
    try:
        return _embed_agreed(model, dataset, listing, existing, data, out, backend, options)
    finally:
        if lock is not None:
            lock.close()


def _fingerprints(dataset: LabelledDataset, backend: Backend) -> np.ndarray:
    """Every item's content fingerprint; rank r reads items r, r + W, ... and the ranks exchange them."""
    count, world, rank = len(dataset), backend.size, backend.rank
    mine = item_fingerprints(dataset, np.arange(rank, count, world))
    if world == 1:
        return mine
    row = np.zeros(-(-count // world), dtype=np.int64)
    row[:len(mine)] = mine
    rows = backend.allgather_numpy(row)
    every = np.empty(count, dtype=np.int64)
    for other in range(world):
        every[other::world] = rows[other][:len(range(other, count, world))]
    return every


def _plan_version(out: Path, existing: dict[str, Any] | None, dataset: LabelledDataset, listing: PartPlan,
                  backend: Backend) -> tuple[VersionPlan, tuple[list[str], list[str], np.ndarray]]:
    """The next version and the source's listing (names, classes, fingerprints); an error is every rank's."""
    names = item_names(dataset)
    classes = [dataset.classes[int(label)] for label in np.asarray(dataset.labels).tolist()]
    table = (names, classes, _fingerprints(dataset, backend))
    try:
        return plan_version(out, existing, table, source=listing.source, part_size=listing.part_size), table
    except ConfigError as error:  # the same files on every rank: the same error, shown once
        raise SharedConfigError(str(error)) from None


def _check_finished_versions(out: Path, existing: dict[str, Any]) -> None:
    """A rerun with nothing new checks what the catalogue holds (shapes, values, each part's SHA-256): a part
    damaged or replaced since it was embedded is refused on every rank in one line. A finished version is not
    re-embedded in place (its ids name the items of its day), so the way on is a new ``--out``."""
    try:
        check_parts(out, existing)
    except ConfigError as error:
        raise SharedConfigError(f"--out: {error}. {out} holds finished versions, which are not embedded again in "
                                "place: embed the source into a new --out (and build its index there)") from None


def _embed_agreed(model: LoadedModel, dataset: LabelledDataset, listing: PartPlan, existing: dict[str, Any] | None,
                  data: str, out: Path, backend: Backend, options: EmbedOptions) -> dict[str, Any] | None:
    """The work, once every rank's set-up succeeded: the ranks agree, embed their unfinished parts, rank 0 ends."""
    _agree_on_setup(backend, None)
    network = backend.setup.prepare_model(model.network)
    _check_ranks_agree(backend, model, listing, data, out)
    version, table = _plan_version(out, existing, dataset, listing, backend)
    if version.empty:
        _check_finished_versions(out, existing)
        if backend.rank == 0:
            print(f"[pksampler] embed: {data} lists what version {len(existing['versions'])} of {out} holds; "
                  "nothing to embed", flush=True)
        return existing if backend.rank == 0 else None
    plan, folder = version.plan, version_folder(out, version.number)
    todo: list[int] = []
    if plan is not None:
        check_existing_parts(folder, plan, model.digest)
        mine = plan.parts_of(backend.rank, backend.size)
        todo = [p for p in mine if not finished(folder, plan, p, model.digest)]
    if backend.rank == 0:
        _announce(version, data, out, backend.size, len(todo), len(mine) - len(todo) if plan is not None else 0)
    images, seconds = _embed_parts(model, network, dataset, plan, todo, folder, backend, options) if todo else (0, 0.)
    totals = backend.allgather_numpy(np.asarray([images, int(seconds * 1000)], dtype=np.int64))
    backend.barrier()
    if backend.rank != 0:
        return None
    rate = float(totals[:, 0].sum()) / max(totals[:, 1].max() / 1000, 1e-9)
    return _finish(out, model, data, version, (table, listing.source), existing, options, rate=rate)


def _announce(version: VersionPlan, data: str, out: Path, world: int, todo: int, skipped: int) -> None:
    plan = version.plan
    cut = f"in {plan.num_parts} parts of {plan.part_size}" if plan is not None else "(nothing to embed)"
    if version.number == 1:
        head = f"{plan.total} images from {data} {cut}"
    else:
        head = (f"version {version.number} of {out}: {version.added} new, {version.changed} changed, "
                f"{len(version.removed)} removed; {plan.total if plan else 0} images from {data} {cut}")
    print(f"[pksampler] embed: {head}, {world} rank(s); rank 0 embeds {todo} part(s), skips {skipped} finished",
          flush=True)


def _version_records(out: Path, model: LoadedModel, plan: PartPlan | None) -> list[dict[str, Any]]:
    """The version's part records, all present and of this model (rank 0, after every rank is done)."""
    if plan is None:
        return []
    records = [read_record(out, part) for part in range(plan.num_parts)]
    missing = [p for p, r in enumerate(records) if r is None]
    if missing:
        raise ConfigError(f"--out: parts {missing[:10]} of {out} have no record after every rank finished; another "
                          "job writes into the same folder?")
    foreign = [p for p, r in enumerate(records) if r.get("model_digest") != model.digest]
    if foreign:  # a job on another host (whose lock this host cannot see) wrote into the folder
        raise ConfigError(f"--out: parts {foreign[:10]} of {out} were embedded by another model (digest "
                          f"{str(records[foreign[0]].get('model_digest'))[:12]}, this job's {model.digest[:12]}) "
                          "while this job ran; give each model its own --out")
    return records


def _finish(out: Path, model: LoadedModel, data: str, version: VersionPlan,
            listing: tuple[tuple[list[str], list[str], np.ndarray], str], existing: dict[str, Any] | None,
            options: EmbedOptions, *, rate: float) -> dict[str, Any]:
    """Rank 0, after every rank is done: check the records, write the version's item table, then the manifest."""
    (table, digest), plan, folder = listing, version.plan, version_folder(out, version.number)
    records = _version_records(folder, model, plan)
    bad = [i for r in records for i in r["bad"]]
    if plan is not None and (len(bad) > options.max_bad_fraction * plan.total or len(bad) == plan.total):
        raise ConfigError(f"--max-bad-fraction: {len(bad)} of {plan.total} images could not be decoded (named "
                          f"above), more than {options.max_bad_fraction:.2%}: fix the data or raise the limit")
    if plan is not None:
        members = plan.members if plan.members is not None else np.arange(plan.total)
        write_items(folder, plan.first_id, [table[0][i] for i in members.tolist()],
                    [table[1][i] for i in members.tolist()], table[2][members])
    entry = {"version": version.number, "added": version.added, "changed": version.changed,
             "removed": version.removed.tolist(), "model_digest": model.digest, "items": ITEMS if plan else None,
             "count": sum(r["count"] for r in records), "bad": len(bad),
             "embedded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    source = {"location": data if is_remote(data) else str(Path(data).resolve()), "kind": source_kind(data),
              "images": len(table[0]), "digest": digest}
    manifest = _next_manifest(existing if version.number > 1 else None, entry, records, plan, bad, model, source)
    write_manifest(out, manifest)
    _report(manifest, version, len(bad), out, rate)
    return manifest


def _next_manifest(existing: dict[str, Any] | None, entry: dict[str, Any], records: list[dict[str, Any]],
                   plan: PartPlan | None, bad: list[int], model: LoadedModel, source: dict[str, Any]
                   ) -> dict[str, Any]:
    """The manifest with version ``entry`` appended (the first version's plan and parts stay at the top, where
    every reader before growth finds them); counts are the live vectors and ids."""
    parts = [{"part": r["part"], "count": r["count"], "first": r["first"], "stop": r["stop"]} for r in records]
    if existing is None:
        return {"model": model.describe(), "source": source,
                "plan": {"total": plan.total, "part_size": plan.part_size, "parts": plan.num_parts},
                "dim": int(records[0]["dim"]) if records else model.embedding_dim,
                "count": entry["count"], "embedded": entry["count"], "bad": len(bad), "bad_ids": bad,
                "next_id": plan.total, "parts": parts, "versions": [entry], "layout": _LAYOUT}
    removed = set(entry["removed"])
    was_bad = set(existing["bad_ids"])
    if plan is not None:
        entry.update(plan={"first_id": plan.first_id, "total": plan.total, "part_size": plan.part_size,
                           "parts": plan.num_parts}, parts=parts)
    bad_ids = sorted(was_bad - removed) + bad
    return {**existing, "source": source, "model": existing["model"],
            "count": existing["count"] - len(removed - was_bad) + entry["count"],
            "embedded": existing["embedded"] + entry["count"], "bad": len(bad_ids), "bad_ids": bad_ids,
            "next_id": plan.first_id + plan.total if plan is not None else existing["next_id"],
            "versions": [*existing["versions"], entry]}


_LAYOUT = {"embeddings": "embeddings/part-*.npy: float32 (n, dim), L2-normalised",
           "ids": "ids/part-*.npy: int64 (n,), the global id of each row of the same part",
           "items": "items.json: each id's name, class and content fingerprint (row j: id first_id + j)",
           "versions": "versions/000v/: version v's parts and items (v >= 2); a version's removed ids are masked"}


def _report(manifest: dict[str, Any], version: VersionPlan, bad: int, out: Path, rate: float) -> None:
    plan = version.plan
    parts = plan.num_parts if plan is not None else 0
    what = "" if version.number == 1 else (f"version {version.number}: {version.added} new, {version.changed} "
                                           f"changed, {len(version.removed)} removed; ")
    print(f"[pksampler] embed: done, {what}{manifest['count']} embeddings of dim {manifest['dim']} in {parts} "
          f"parts, {bad} bad image(s) skipped; this job embedded at {rate:.0f} img/s; {out / MANIFEST}", flush=True)
