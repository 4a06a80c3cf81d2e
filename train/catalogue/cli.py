"""The command lines of the catalogue steps; the scripts beside ``train/retrieval.py`` call these.

Bad input is one line on stderr (``error: <argument>: <value>: <rule>``),
from rank 0 when every rank hits it, else from the rank that did (``error:
rank 1: ...``), and exit status 2; a rank stopped by a peer says so in one
line. Only an unexpected error (a bug) prints a traceback, on rank 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

from pksampler.comm import add_local_rank_argument, adopt_local_rank
from pksampler.train.errors import ConfigError, SharedConfigError

__all__ = ["build_index_main", "embed_main", "export_main", "query_main"]

#: how long ranks other than 0 wait for rank 0 to report an error before exiting themselves
_PEER_WAIT_SECONDS = 30.0


def _rank() -> int:
    try:
        from pksampler.comm import world_info

        return world_info()[0]
    except ValueError:
        return 0


#: what a rank's collective raises when a peer has exited (its own error says nothing about the cause)
_PEER_FAILED = ("HorovodInternalError", "DistBackendError")


def _run(step: Callable[[], object]) -> int:
    """Run ``step``; an error is one line on stderr, no traceback, and status 2 (1 for an unexpected one).

    * A ConfigError that every rank raises together (:class:`SharedConfigError`) is
      printed by rank 0; the other ranks wait for it, then exit.
    * Any other ConfigError, or an OSError, is the rank's own (its file, its
      host): that rank prints it, prefixed with its rank when not 0, and exits.
    * A collective that failed because a peer exited is one line saying so:
      the peer printed the cause.
    * Anything else: rank 0 prints the traceback (a bug), other ranks one line.
    """
    rank = _rank()
    where = f"rank {rank}: " if rank else ""
    try:
        step()
    except ConfigError as error:
        if rank == 0 or not isinstance(error, SharedConfigError):
            print(f"error: {where}{error}", file=sys.stderr, flush=True)
            return 2
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
        time.sleep(_PEER_WAIT_SECONDS)
        return 2
    except OSError as error:
        print(f"error: {where}{error}", file=sys.stderr, flush=True)
        return 2
    except Exception as error:  # noqa: BLE001 - shown once, then a non-zero exit
        if type(error).__name__ in _PEER_FAILED:
            print(f"[pksampler] rank {rank}: stopped: a collective failed because another rank stopped "
                  f"({type(error).__name__}); that rank's error is above", file=sys.stderr, flush=True)
        elif rank == 0:
            traceback.print_exc()
        else:
            frame = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
            print(f"[pksampler] rank {rank}: {type(error).__name__}: {error}"
                  f"{f' at {frame.filename}:{frame.lineno}' if frame else ''} (traceback on rank 0)",
                  file=sys.stderr, flush=True)
        sys.stderr.flush()
        return 1
    return 0


def _parser(description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def export_main(argv: list[str] | None = None) -> int:
    parser = _parser("Export a training checkpoint's embedding model as ONNX and torch.export (.pt2).")
    parser.add_argument("checkpoint", type=Path, help="best.pt or last.pt written by train/retrieval.py")
    parser.add_argument("--out", type=Path, required=True, help="folder for model.onnx and model.pt2")
    parser.add_argument("--formats", default="onnx,pt2", help="comma-separated: onnx, pt2 (default: both)")
    args = parser.parse_args(argv)

    def step() -> None:
        from pksampler.train.catalogue.export import export_model, read_metadata

        written = export_model(args.checkpoint, args.out, formats=tuple(f for f in args.formats.split(",") if f))
        for name, path in written.items():
            meta = read_metadata(path)
            print(f"[pksampler] export: {path} ({name}, {path.stat().st_size} bytes, input uint8 "
                  f"(batch, 3, {meta['preprocessing']['input_size']}, {meta['preprocessing']['input_size']}), "
                  f"embedding {meta['embedding_dim']}, digest {meta['digest'][:12]})", flush=True)
    return _run(step)


def embed_main(argv: list[str] | None = None) -> int:
    parser = _parser("Embed a catalogue's images into .npy parts, on one process, under horovodrun or torchrun (or "
                     "python -m torch.distributed.launch).")
    parser.add_argument("--checkpoint", type=Path, required=True, help="best.pt or last.pt written by train/retrieval.py")
    parser.add_argument("--data", required=True, help="an image folder, a list file, a packed shard folder or s3://...")
    parser.add_argument("--out", type=Path, required=True, help="the catalogue folder (parts and manifest.json)")
    parser.add_argument("--part-size", type=int, default=65536, help="images per part (default 65536)")
    parser.add_argument("--batch-size", type=int, default=128, help="images per forward pass (default 128)")
    parser.add_argument("--workers", type=int, default=2, help="decoding workers per rank (default 2)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (each rank: its local GPU)")
    parser.add_argument("--precision", default="auto", help="auto, fp32, bf16 or fp16 (autocast)")
    parser.add_argument("--max-bad-fraction", type=float, default=0.01, help="fail above this share of bad images")
    parser.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--outage-seconds", type=float, default=60.0,
                        help="s3:// only: how long a store that does not answer is retried before the job stops (60)")
    add_local_rank_argument(parser)
    args = parser.parse_args(argv)

    def step() -> None:
        try:
            adopt_local_rank(args.local_rank)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        from pksampler.train.catalogue.embed import EmbedOptions, embed_catalogue
        from pksampler.train.runtime.distributed import make_backend

        options = EmbedOptions(part_size=args.part_size, batch_size=args.batch_size, workers=args.workers,
                               progress_every=args.progress_every, max_bad_fraction=args.max_bad_fraction,
                               device=args.device, precision=args.precision, outage_seconds=args.outage_seconds)
        backend = make_backend("auto", device=options.device, precision=options.precision)
        try:
            embed_catalogue(args.checkpoint, args.data, args.out, backend, options=options)
            backend.barrier()
        finally:
            backend.shutdown()
    return _run(step)


def build_index_main(argv: list[str] | None = None) -> int:
    parser = _parser("Build a faiss index over an embedded catalogue, with a recall certificate; an index of an "
                     "earlier version of the same catalogue in --out is updated in place.")
    parser.add_argument("catalogue", type=Path, help="the folder train/embed_catalogue.py wrote")
    parser.add_argument("--out", type=Path, required=True, help="folder for index.faiss and index.json")
    parser.add_argument("--kind", default="auto", help="auto (flat up to --flat-limit, else ivfflat), flat, ivfflat, ivfpq")
    parser.add_argument("--flat-limit", type=int, default=1_000_000, help="largest catalogue indexed exactly by auto")
    parser.add_argument("--nlist", type=int, default=None, help="IVF lists (default: a power of two near sqrt(N))")
    parser.add_argument("--pq-bytes", type=int, default=None, help="ivfpq: bytes per code (default dim / 4)")
    parser.add_argument("--queries", type=int, default=2000, help="sampled queries of the recall certificate")
    parser.add_argument("--target", type=float, default=0.99, help="Recall@1 the search setting must reach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rebuild", action="store_true",
                        help="build afresh (retrain the IVF centroids, certify again) instead of updating")
    parser.add_argument("--drift-limit", type=float, default=1.2,
                        help="update: the new vectors' mean squared distance to their IVF centroids, as a multiple "
                             "of the indexed ones', past which the update says to --rebuild (1.2)")
    parser.add_argument("--compact-fraction", type=float, default=0.1,
                        help="update: merge the delta into the base file once it passes this share of it (0.1)")
    args = parser.parse_args(argv)

    def step() -> None:
        from pksampler.train.catalogue.index import IndexOptions
        from pksampler.train.catalogue.update import grow_index

        options = IndexOptions(kind=args.kind, flat_limit=args.flat_limit, nlist=args.nlist, pq_bytes=args.pq_bytes,
                               queries=args.queries, target=args.target, seed=args.seed, rebuild=args.rebuild,
                               drift_limit=args.drift_limit, compact_fraction=args.compact_fraction)
        meta = grow_index(args.catalogue, args.out, options=options)
        print(_index_line(meta, args.catalogue, args.out), flush=True)
        drift = meta.get("last_drift") or {}
        if meta["history"][-1]["how"] in ("updated", "compacted") and drift.get("retrain"):
            print(f"[pksampler] index: drift: the {drift['vectors']} vectors added since the base was built lie "
                  f"{drift['ratio']:.2f}x as far from their IVF centroids as the indexed ones (mean squared distance "
                  f"{drift['mean_sq_distance']:.4f} against {drift['base_mean_sq_distance']:.4f}, past --drift-limit "
                  f"{drift['limit']:g}): retrain the coarse quantizer: python train/build_index.py {args.catalogue} "
                  f"--out {args.out} --rebuild", flush=True)
    return _run(step)


def _index_line(meta: dict, catalogue: Path, out: Path) -> str:
    """The one line that says what ``build_index.py`` did: built, updated, compacted, or nothing to do."""
    last = meta["history"][-1]
    if last["how"] == "up to date":
        return (f"[pksampler] index: {out} already holds version {last['version']} of {catalogue}; nothing to "
                "update")
    if last["how"] != "built":
        drift = meta["last_drift"]
        fit = (f"drift {drift['ratio']:.2f}x (limit {drift['limit']:g})" if drift["applies"] else "exact: no drift")
        held = (f"the delta of +{last['delta_added']} -{last['delta_removed']} merged into a new base file"
                if last["how"] == "compacted" else
                f"{meta['base_count']} in the base file, delta +{last['delta_added']} -{last['delta_removed']}")
        return (f"[pksampler] index: {last['how']} to version {last['version']} in {last['seconds']:.2f} s: "
                f"+{last['added']} vectors, -{last['removed']} ids; {meta['count']} live ({held}); {fit}; "
                f"{out / meta['index_file']}")
    cert = meta["certificate"]
    return (f"[pksampler] index: {meta['kind']} over {meta['count']} x {meta['dim']} in {meta['build_seconds']:.1f} s"
            + (f", nlist {meta['nlist']} nprobe {meta['nprobe']}" if meta["nlist"] else "")
            + (f"; Recall@1 {cert['recall_at_1']:.4f} Recall@10 {cert['recall_at_10']:.4f} against exact search on "
               f"{cert['queries']} sampled queries" if cert.get("queries") else "")
            + f"; {out / meta['index_file']}")


def query_main(argv: list[str] | None = None) -> int:
    parser = _parser("Search the catalogue with images: top-k as JSON lines and a gallery PNG.")
    parser.add_argument("images", nargs="+", help="query image files or folders")
    parser.add_argument("--index", type=Path, required=True, help="the folder train/build_index.py wrote")
    parser.add_argument("--checkpoint", type=Path, required=True, help="the checkpoint the catalogue was embedded with")
    parser.add_argument("--out", type=Path, required=True, help="folder for results.jsonl and gallery.png")
    parser.add_argument("--k", type=int, default=10, help="results per query (default 10)")
    parser.add_argument("--gallery-rows", type=int, default=8, help="queries shown in the gallery (default 8)")
    args = parser.parse_args(argv)

    def step() -> None:
        from pksampler.train.catalogue.query import query_catalogue

        lines = query_catalogue(args.index, args.images, args.out, checkpoint=args.checkpoint, k=args.k,
                                gallery_rows=args.gallery_rows)
        bad = sum("error" in line for line in lines)
        print(f"[pksampler] query: {len(lines)} queries ({bad} unreadable), top {args.k}: "
              f"{args.out / 'results.jsonl'}, {args.out / 'gallery.png'}", flush=True)
    return _run(step)
