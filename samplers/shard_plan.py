"""The shard-local P x K plan: the default plan's chunks, laid out so that a rank reads shard by shard.

At 10^8 images in an object store the default plan sends every K-chunk of a
rank to a random shard: a rank touches nearly every shard each epoch and the
cluster needs tens of thousands of GETs per second. This plan keeps the
default plan's contract (:mod:`.pk_plan`) and changes only where chunks sit:

1. Chunk counts, S and the dropped remainder are exactly the default plan's
   (:func:`.pk_plan.epoch_runs` with the same ``(seed, epoch)`` generator),
   so every class gets the same chunks per epoch as under the default plan.
2. The epoch's classes are ordered by a seeded walk over the shards (a
   permutation of shard ids keyed by ``(seed, epoch)``), and inside a shard
   in stored order. The packer writes shards class by class, so the classes
   of one shard that follow each other in this order are adjacent sample
   indices: one contiguous byte range.
3. The chunk sequence is cut into G columns of S positions, as in the
   default plan. The G slots of a step are the plan's canonical *lanes*:
   lane j is column j for the whole epoch (no per-step rotation), so a lane
   walks its shards in order and its reads stay in one shard for a *visit*
   of hundreds of chunks. The lanes are fixed by G, never by W: rank r takes
   the same contiguous run of lanes as in the default plan, so the global
   batches are the same at every W from 1 to G.
4. Inside a lane, positions are shuffled within windows of ``window``
   consecutive steps (a seeded permutation per window and lane), so a class
   meets different classes of other lanes than a pure in-order walk would.
   A visit's chunks are read in a shuffled order within the windows its
   positions fall in; the larger the window, the more varied the
   batch-mates and the longer a reader keeps a visit's bytes. A class split across two
   lanes is repaired exactly as in the default plan (few chunks move).
5. Members of a chunk follow the default plan's per-epoch keyed permutation
   of the class: K-groups are re-drawn every epoch inside the class's
   contiguous range, so positive pairs are as varied as the default plan's.

Layout picture (one shard, classes a, b, c; K = 2)::

    shard-000042.tar : a a a a a a | b b b b | c c c c c c c c
    lane 7, steps 300..309 : a b a c b c a c c a   (one visit: one byte range)

Memory: O(C + S*G) per epoch, like the default plan (no per-sample state:
the shard of a class is one integer per class, taken from the per-sample
shard ids once when the sampler is built).
"""

from __future__ import annotations

import numpy as np

from ._labels import ClassIndex
from .pk_plan import EpochLayout, epoch_rng, epoch_runs, position_dtype, repair_splits

__all__ = ["DEFAULT_WINDOW", "class_shards", "shard_layout", "visits_of", "window_positions"]

#: steps per shuffle window of a lane (step 4 of the module docstring)
DEFAULT_WINDOW = 2048
_SHARD_STREAM = 1  # the generator stream of the shard walk, the windows and the member key


def class_shards(index: ClassIndex, shard_of: np.ndarray, *, owner: str = "shard_layout") -> np.ndarray:
    """The shard of every class: the shard of its first member, one integer per class.

    Raises ValueError when ``shard_of`` does not give one non-negative shard
    id per sample.
    """
    shard_of = np.asarray(shard_of)
    count = int(index.offsets[-1])
    if shard_of.ndim != 1 or shard_of.shape[0] != count or not np.issubdtype(shard_of.dtype, np.integer):
        raise ValueError(f"{owner}(shard_ids=) must be one integer shard id per sample ({count}), "
                         f"got an array of shape {shard_of.shape} and dtype {shard_of.dtype}")
    if count and int(shard_of.min()) < 0:
        raise ValueError(f"{owner}(shard_ids=) must be non-negative, got {int(shard_of.min())}")
    first = index.members[index.offsets[:-1][index.sizes > 0]]
    shards = np.zeros(index.num_classes, dtype=np.int64)
    shards[index.sizes > 0] = shard_of[first]
    return shards


def window_positions(num_steps: int, columns: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """``position_of`` (G, S): per lane, a random bijection that moves positions only inside their window."""
    keys = rng.random((columns, num_steps))
    keys += (np.arange(num_steps) // window)[None, :]
    return np.argsort(keys, axis=1).astype(position_dtype(num_steps), copy=False)


def shard_layout(
    index: ClassIndex,
    classes_per_step: int,
    samples_per_class: int,
    shard_of_class: np.ndarray,
    *,
    seed: int,
    epoch: int,
    small_classes: str = "repeat",
    class_weighting: float = 1.0,
    window: int = DEFAULT_WINDOW,
    cache: dict | None = None,
) -> EpochLayout:
    """The shard-local layout of one epoch (module docstring); sliced by :func:`.pk_plan.rank_batches`."""
    local = epoch_rng(seed, epoch, _SHARD_STREAM)
    walk = local.permutation(int(shard_of_class.max()) + 1 if shard_of_class.size else 1)

    first_member = index.members[np.minimum(index.offsets[:-1], max(int(index.offsets[-1]) - 1, 0))]

    def by_shard(codes: np.ndarray) -> np.ndarray:  # the shard walk, then stored order inside a shard
        return np.lexsort((first_member[codes], walk[shard_of_class[codes]]))

    class_order, starts, run_of, num_steps = epoch_runs(
        index, classes_per_step, samples_per_class, epoch_rng(seed, epoch), small_classes=small_classes,
        class_weighting=class_weighting, cache=cache, order=by_shard,
    )
    position_of = window_positions(num_steps, classes_per_step, window, local)
    repair_splits(position_of, starts)
    return EpochLayout(
        num_steps=num_steps,
        classes_per_step=classes_per_step,
        class_order=class_order,
        starts=starts,
        run_of=run_of,
        position_of=position_of,
        slot_shift=np.zeros(num_steps, dtype=np.int64),
        member_key=np.uint64(local.integers(0, 2**63, dtype=np.int64)),
    )


def visits_of(lane_steps: np.ndarray, shard_of: np.ndarray) -> list[tuple[int, int]]:
    """Visits of one lane over consecutive steps: ``(shard, chunks)`` per shard, in order of first read.

    ``lane_steps`` is ``(steps, K)`` sample indices of one lane (one class
    slot of a rank over consecutive steps); ``shard_of`` the per-sample shard
    ids. Inside a visit the lane's chunks are adjacent classes of one shard,
    so a reader fetches the visit's byte range once (at most two visits of a
    lane overlap in time, where a shuffle window crosses a shard boundary).
    """
    shards = np.asarray(shard_of)[np.asarray(lane_steps).reshape(len(lane_steps), -1)[:, 0]]
    unique, first, chunks = np.unique(shards, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    return [(int(unique[i]), int(chunks[i])) for i in order]
