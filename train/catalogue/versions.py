"""A catalogue's versions: the item table each version adds, and what the next version embeds and removes.

1. Every version writes ``items.json`` beside its parts: for each id it
   assigned (consecutive from its first id), the item's name (its identity:
   the path relative to the source's root, or a shard member), its class
   and a content fingerprint (:func:`~.sources.item_fingerprints`).
2. Embedding the source again compares its listing with the live items
   (every version's items less the ids some version removed): a name not
   seen before is added under a new id, drawn from the counter ``next_id``
   (ids are never reused); a name whose fingerprint or class changed is
   removed and added again under a new id; a name no longer listed is
   removed. Nothing else is embedded again.
3. Queries name their results from these tables (:class:`ItemNames`), so a
   result names what was embedded, whatever the source holds today.

A catalogue embedded before growth was recorded has no table: it is read
as it always was, and growing it is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pksampler.datasets._image import read_regular
from pksampler.files import atomic_write_text

from pksampler.train.catalogue.parts import PartPlan, catalogue_versions, removed_ids, version_folder, writing
from pksampler.train.errors import ConfigError

__all__ = ["ITEMS", "ItemNames", "VersionPlan", "live_items", "plan_version", "read_items", "write_items"]

ITEMS = "items.json"
ITEMS_FORMAT = "pksampler-catalogue-items"


@dataclass(frozen=True)
class VersionPlan:
    """What embedding the source now makes of the catalogue: version ``number``, the items it embeds (``plan``,
    None when none), the ids it removes, and how many of its items are new names and changed images."""

    number: int
    plan: PartPlan | None
    removed: np.ndarray
    added: int
    changed: int

    @property
    def empty(self) -> bool:
        """Nothing to embed and nothing to remove: the catalogue already is the source."""
        return self.number > 1 and self.plan is None and not self.removed.size


def write_items(folder: Path, first_id: int, names: list[str], classes: list[str], fingerprints: np.ndarray) -> None:
    """The version's item table (row ``j`` is id ``first_id + j``), written atomically."""
    table = {"format": ITEMS_FORMAT, "first_id": first_id, "names": names, "classes": classes,
             "fingerprints": np.asarray(fingerprints, dtype=np.int64).tolist()}
    with writing(folder / ITEMS):
        atomic_write_text(folder / ITEMS, json.dumps(table))


def read_items(catalogue: Path, number: int) -> dict[str, Any]:
    """Version ``number``'s item table, or one ConfigError naming the file."""
    path = version_folder(catalogue, number) / ITEMS
    try:
        table = json.loads(read_regular(path).decode("utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: the item table of version {number} cannot be read ({error}); embed the "
                          "catalogue again into a new folder") from None
    lengths = {len(table.get(k, ())) for k in ("names", "classes", "fingerprints")} if isinstance(table, dict) else {}
    if not isinstance(table, dict) or table.get("format") != ITEMS_FORMAT or len(lengths) != 1:
        raise ConfigError(f"{path}: not an item table (names, classes and fingerprints of equal length); embed the "
                          "catalogue again into a new folder")
    return table


def _tables(catalogue: Path, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    versions = catalogue_versions(manifest)
    if "versions" not in manifest or any(v.items is None for v in versions if v.total):
        raise ConfigError(f"--out: {catalogue} was embedded before catalogues recorded their items (no item table), "
                          "so it cannot grow in place; embed the source into a new --out and build a new index")
    return [read_items(catalogue, v.number) for v in versions if v.total]


def live_items(catalogue: Path, manifest: dict[str, Any]) -> dict[str, tuple[int, int, str]]:
    """``name -> (id, fingerprint, class)`` of every item the catalogue holds now."""
    gone = set(removed_ids(manifest).tolist())
    live: dict[str, tuple[int, int, str]] = {}
    for table in _tables(catalogue, manifest):
        for row, (name, fingerprint, label) in enumerate(zip(table["names"], table["fingerprints"],
                                                             table["classes"])):
            if table["first_id"] + row not in gone:
                live[name] = (table["first_id"] + row, fingerprint, label)
    return live


def plan_version(catalogue: Path, manifest: dict[str, Any] | None, listing: tuple[list[str], list[str], np.ndarray],
                 *, source: str, part_size: int) -> VersionPlan:
    """The next version for the source's ``listing`` (names, classes, fingerprints); version 1 when ``catalogue``
    holds no finished manifest, or one of the same listing written before growth was recorded (a restart)."""
    names, classes, fingerprints = listing
    if manifest is None or ("versions" not in manifest and manifest["source"].get("digest") == source):
        return VersionPlan(1, PartPlan(len(names), part_size, source), np.zeros(0, np.int64), len(names), 0)
    live = _live_checked(catalogue, manifest)
    members, removed, changed = [], [], 0
    for index, (name, label, fingerprint) in enumerate(zip(names, classes, fingerprints.tolist())):
        held = live.get(name)
        if held is None or held[1:] != (fingerprint, label):
            members.append(index)
            if held is not None:
                removed.append(held[0])
                changed += 1
    listed = set(names)
    removed += [held[0] for name, held in live.items() if name not in listed]
    number, first = len(manifest["versions"]) + 1, int(manifest["next_id"])
    plan = PartPlan(len(members), part_size, source, first, np.asarray(members, dtype=np.int64)) if members else None
    return VersionPlan(number, plan, np.asarray(sorted(removed), dtype=np.int64), len(members) - changed, changed)


def _live_checked(catalogue: Path, manifest: dict[str, Any]) -> dict[str, tuple[int, int, str]]:
    live = live_items(catalogue, manifest)
    if not isinstance(manifest.get("next_id"), int):
        raise ConfigError(f"{catalogue / 'manifest.json'}: next_id is missing; embed the catalogue again into a new "
                          "folder")
    return live


class ItemNames:
    """Each id's name and class as embedded (every version's table, removed ids included: an index not yet
    updated may still return them)."""

    def __init__(self, catalogue: str | Path, manifest: dict[str, Any]) -> None:
        tables = _tables(Path(catalogue), manifest)
        self._firsts = np.asarray([t["first_id"] for t in tables], dtype=np.int64)
        self._tables = tables

    def __call__(self, item: int) -> tuple[str, str]:
        """``(name, class)`` of id ``item``."""
        table = self._tables[int(np.searchsorted(self._firsts, item, side="right")) - 1]
        row = item - table["first_id"]
        return table["names"][row], table["classes"][row]
