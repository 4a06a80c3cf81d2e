"""Packed shards in an S3-compatible object store: ranged GETs, coalesced per batch, counted.

``ShardedDataset("s3://bucket/prefix")`` (:mod:`.sharded`) keeps the pack's
small files (``manifest.json``, ``index.npy``, ``labels.npy``) in a node-local
cache and reads image bytes from the shards with ranged GETs through this
module:

* **Client.** obstore (Rust's ``object_store``): about 0.5 ms of client CPU per
  GET on loopback, against about 3.4 ms for boto3, and its own retries with
  exponential backoff on 5xx, SlowDown and connection errors.
* **Credentials** come from the standard variables only: ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL`` (an
  S3-compatible server: path-style addressing, ``http://`` allowed) and
  ``AWS_REGION`` (default ``us-east-1``). Nothing here prints, logs or pickles
  a secret: a pickled store carries the URL alone and rebuilds its client from
  the environment of the process that loads it.
* **Coalescing.** :meth:`ObjectStore.get_ranges` merges byte ranges of one
  object that lie within ``gap`` bytes (1 MiB) of each other into one GET
  and fetches the runs in parallel: a K-chunk of one class (its samples lie
  in the class's stretch of a shard) is one request, never a whole-shard
  download.
* **Errors.** A missing object or a refused credential is one line naming the
  bucket and key (:class:`ObjectStoreError`); an object replaced since the
  upload is refused by the server (``If-Match``, :class:`ObjectChangedError`).
* **Outages.** A store that stops answering (connection errors, 5xx, a
  gateway refusing signed requests while it restarts) is retried with backoff
  for ``outage_seconds`` (default 300 s) before a read fails; the job waits
  rather than dies.
* **Accounting.** GETs and bytes, summed over DataLoader workers through shared
  memory (:meth:`ObjectStore.counts`); at $0.0004 per 1,000 GETs (S3 standard)
  :func:`cost_usd` gives the bill.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import get_worker_info

from pksampler.files import atomic_write_bytes
from pksampler.locations import OBJECT_STORE_SCHEME, is_remote

__all__ = ["DEFAULT_OUTAGE_SECONDS", "GET_PRICE_USD", "ObjectChangedError", "ObjectStore", "ObjectStoreError",
           "OutageError", "cost_usd", "split_url"]

#: S3 standard, per GET request (us-east-1): $0.0004 per 1,000
GET_PRICE_USD = 0.0004 / 1000
#: how long a store that fails (connection errors, 5xx, a gateway refusing while it restarts) is retried before a
#: read fails: data.args.outage_seconds / ShardedDataset(outage_seconds=)
DEFAULT_OUTAGE_SECONDS = 300.0
_COUNTER_ROWS = 65  # row 0: the main process; rows 1..64: DataLoader workers (by worker id)
_ENVIRONMENT = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_REGION")


class ObjectStoreError(OSError):
    """A request the store refused or could not answer after its retries; the message names bucket and key."""


class OutageError(ObjectStoreError):
    """The store failed for longer than the outage budget. ``failure`` is the last request's one line, ``seconds``
    how long the store failed: a command with its own option for the budget names it with these."""

    def __init__(self, message: str, failure: str = "", seconds: float = 0.0) -> None:
        super().__init__(message)
        self.failure, self.seconds = failure or message, seconds


class ObjectChangedError(ObjectStoreError):
    """An object is not the one the pack's manifest describes: replaced, cut or grown on the store since upload."""


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; a bad URL is a ValueError naming it."""
    rest = url[len(OBJECT_STORE_SCHEME):] if is_remote(url) else ""
    if not rest.split("/", 1)[0]:
        raise ValueError(f"an object-store location must look like s3://bucket/prefix, got {url!r}")
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


def cost_usd(gets: int) -> float:
    """What ``gets`` GET requests cost at S3's standard price."""
    return gets * GET_PRICE_USD


#: the process whose obstore client started the Rust runtime: a fork of it cannot use obstore (the runtime's
#: threads are not copied and the child would wait forever), so a forked child is told so instead
_RUNTIME_PROCESS: int | None = None


def _counter_row() -> int:
    info = get_worker_info()
    return 0 if info is None else 1 + info.id % (_COUNTER_ROWS - 1)


class ObjectStore:
    """One bucket and prefix of an S3-compatible store, read with ranged GETs.

    Args:
        url: ``s3://bucket/prefix``.
        environ: where the ``AWS_*`` variables come from (default ``os.environ``).
    """

    def __init__(self, url: str, *, environ: dict[str, str] | None = None,
                 outage_seconds: float = DEFAULT_OUTAGE_SECONDS) -> None:
        if isinstance(outage_seconds, bool) or not isinstance(outage_seconds, (int, float)) or \
                not 0 < outage_seconds <= 7 * 24 * 3600:
            raise ValueError(f"ObjectStore(outage_seconds=) must be a number of seconds in (0, 604800], got "
                             f"{outage_seconds!r}")
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(self.url)
        self.outage_seconds = float(outage_seconds)
        self._environ = environ
        self._store: Any = None
        self._pid = -1
        self._answered = False  # a request succeeded: the credentials work, so a refusal is an outage
        self._counts = torch.zeros(_COUNTER_ROWS, 2, dtype=torch.int64).share_memory_()

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "_counts": self._counts, "outage_seconds": self.outage_seconds,
                "_answered": self._answered}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], outage_seconds=state.get("outage_seconds", DEFAULT_OUTAGE_SECONDS))
        self._counts = state["_counts"]
        self._answered = bool(state.get("_answered", False))

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _client(self) -> Any:
        """The obstore client, built in each process from the environment (never pickled, never printed)."""
        global _RUNTIME_PROCESS
        if _RUNTIME_PROCESS is not None and _RUNTIME_PROCESS != os.getpid():
            raise ObjectStoreError(
                f"{self.url}: this process was forked from one that had already used the object store, and its "
                "client cannot run in a fork; give the DataLoader multiprocessing_context='spawn' (the trainer does)")
        if self._store is None or self._pid != os.getpid():
            from obstore.store import S3Store

            environ = os.environ if self._environ is None else self._environ
            endpoint = environ.get("AWS_ENDPOINT_URL")
            options: dict[str, Any] = {"region": environ.get("AWS_REGION", "us-east-1")}
            for variable, option in (("AWS_ACCESS_KEY_ID", "access_key_id"),
                                     ("AWS_SECRET_ACCESS_KEY", "secret_access_key"),
                                     ("AWS_SESSION_TOKEN", "session_token")):
                if environ.get(variable):
                    options[option] = environ[variable]
            if endpoint:
                options.update(endpoint=endpoint, virtual_hosted_style_request=False)
            # obstore's own retries stay within the outage budget; the loop in _request_retried spans the rest
            retry = {"max_retries": 10, "retry_timeout": timedelta(seconds=min(30.0, self.outage_seconds)),
                     "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=10),
                                 "base": 2.0}}
            # a store that accepts and never answers costs one request's timeout: keep it inside the budget too
            client_options = {"allow_http": bool(endpoint and endpoint.startswith("http://")),
                              "connect_timeout": timedelta(seconds=min(10.0, self.outage_seconds)),
                              "timeout": timedelta(seconds=min(120.0, self.outage_seconds))}
            self._store = S3Store(self.bucket, retry_config=retry, client_options=client_options, **options)
            self._pid = _RUNTIME_PROCESS = os.getpid()
        return self._store

    def _fail(self, name: str, error: Exception) -> ObjectStoreError:
        kind = type(error).__name__
        reason = {"NotFoundError": "no such object", "PermissionDeniedError": "access denied (check AWS_* credentials)",
                  "UnauthenticatedError": "the credentials were refused (check AWS_ACCESS_KEY_ID and "
                                          "AWS_SECRET_ACCESS_KEY)"}.get(kind)
        if reason is None:
            text = str(error)
            status = re.search(r"status code: (\d{3}[^:<]*)", text)
            first = text.splitlines()[0][:200] if text else kind
            reason = f"{kind}: {first}"
            if status:
                reason = f"the store answered {status.group(1).strip()}"
            elif re.search(r"error sending request|connection|timed out|HTTP error", text, re.IGNORECASE):
                reason = "the store did not answer (connection refused, reset or timed out)"
            # a status code as a word of its own, outside the request's address (which holds the key: images filed
            # by class id, .../404/0001.jpg): the text also holds durations ("after 1.404s")
            bare = re.sub(r"\b\w+://\S+", "<address>", text)
            if re.search(r"(?<![.\w])403(?![.\w])|Forbidden|AccessDenied", bare):
                reason = "access denied (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            elif re.search(r"(?<![.\w])404(?![.\w])|NoSuchKey|NoSuchBucket", bare):
                reason = "no such object or bucket"
        return ObjectStoreError(f"s3://{self.bucket}/{self.key(name)}: {reason}")

    def changed(self, name: str, what: str) -> ObjectChangedError:
        """The one-line error for an object that is not the one the manifest describes."""
        return ObjectChangedError(f"s3://{self.bucket}/{self.key(name)}: {what}: the object changed on the store "
                                  "since the pack was uploaded (or since the job started); upload the pack again "
                                  "(manifest last) and restart")

    def _request(self, name: str, call: Any) -> Any:
        try:
            return self._request_retried(name, call)
        except ObjectStoreError:
            raise
        except Exception as error:  # noqa: BLE001 - a 412 from If-Match
            if type(error).__name__ == "PreconditionError":
                raise self.changed(name, "its ETag no longer matches (412 Precondition Failed)") from None
            raise

    def _request_retried(self, name: str, call: Any) -> Any:
        """``call()`` with obstore's own retries (5xx, SlowDown, connection errors) and, past them, more tries with
        backoff until the store has failed for ``outage_seconds``: an outage within the budget costs time, not the
        job. A missing object fails at once. A refused credential fails after ~3.5 s while this store has never
        answered (a wrong secret); after it has, a refusal is a gateway restarting, part of the outage."""
        failing_since, wait, refusals = None, 0.5, 0
        while True:
            attempt = time.monotonic()  # an outage starts when the first failed request was sent, not when it ended
            try:
                result = call()
            except Exception as error:  # noqa: BLE001 - obstore's exception types, turned into one line
                if type(error).__name__ == "PreconditionError":
                    raise
                failure = self._fail(name, error)
                refused = "access denied" in str(failure) or "credentials were refused" in str(failure)
                if "no such object" in str(failure) or (refused and not self._answered and refusals == 3):
                    raise failure from None
                refusals += refused
                now = time.monotonic()
                failing_since = attempt if failing_since is None else failing_since
                if now - failing_since >= self.outage_seconds:
                    raise OutageError(f"{failure}; the store failed for {now - failing_since:.0f} s, past the "
                                      f"outage budget of {self.outage_seconds:g} s (data.args.outage_seconds, "
                                      "ShardedDataset(outage_seconds=))", str(failure), now - failing_since) from None
                time.sleep(min(wait, max(self.outage_seconds - (now - failing_since), 0.0)))
                wait = min(2 * wait, 10.0)
                continue
            self._answered = True
            return result

    def _count(self, gets: int, size: int) -> None:
        row = _counter_row()
        self._counts[row, 0] += gets
        self._counts[row, 1] += size

    def counts(self) -> tuple[int, int]:
        """(GETs, bytes) of this store in this process and its DataLoader workers."""
        total = self._counts.sum(dim=0)
        return int(total[0]), int(total[1])

    def get(self, name: str) -> bytes:
        """The whole object ``prefix/name`` (the pack's small files)."""
        import obstore

        data = self._request(name, lambda: bytes(obstore.get(self._client(), self.key(name)).bytes()))
        self._count(1, len(data))
        return data

    def get_ranges(self, name: str, ranges: Sequence[tuple[int, int]], *, gap: int = 1 << 20,
                   etag: str | None = None) -> list[bytes]:
        """The bytes ``[start, end)`` of each range of ``prefix/name``: one GET per run of ranges less than ``gap``
        bytes apart (a K-chunk of one class, whose samples lie within the class's stretch of the shard), the runs
        fetched in parallel (up to 10 at a time).

        With ``etag``, every GET carries ``If-Match: etag``: an object replaced on the store since then is refused
        by the server (412) and raised as :class:`ObjectChangedError`, never read.
        """
        import obstore

        order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
        runs: list[list[int]] = []
        for i in order:
            if runs and ranges[i][0] <= max(ranges[j][1] for j in runs[-1]) + gap:
                runs[-1].append(i)
            else:
                runs.append([i])
        starts = [min(ranges[i][0] for i in run) for run in runs]
        ends = [max(ranges[i][1] for i in run) for run in runs]
        client = self._client()
        if etag is None:
            fetched = self._request(name, lambda: obstore.get_ranges(client, self.key(name), starts=starts, ends=ends,
                                                                     coalesce=0))
        else:
            fetched = self._request(name, lambda: _run(_get_if_match(client, self.key(name), starts, ends, etag)))
        out: list[bytes] = [b""] * len(ranges)
        for run, start, data in zip(runs, starts, fetched):
            data = memoryview(data)
            self._count(1, len(data))
            for i in run:
                out[i] = bytes(data[ranges[i][0] - start:ranges[i][1] - start])
        return out

    def put(self, name: str, data: bytes) -> str | None:
        """Write ``prefix/name``; returns the object's ETag (None if the store gives none)."""
        import obstore

        result = self._request(name, lambda: obstore.put(self._client(), self.key(name), data))
        return result.get("e_tag") if isinstance(result, dict) else None

    def head(self, name: str) -> tuple[int, str | None]:
        """(size, ETag) of ``prefix/name`` (one HEAD request)."""
        import obstore

        meta = self._request(name, lambda: obstore.head(self._client(), self.key(name)))
        self._count(1, 0)
        return int(meta["size"]), meta.get("e_tag")

    def identity(self) -> str:
        """The endpoint and URL of this store (no secret): what keys node-local copies of its objects."""
        environ = os.environ if self._environ is None else self._environ
        return f"{environ.get('AWS_ENDPOINT_URL', '')}|{self.url}"

    def cache_folder(self) -> Path:
        """Node-local folder for the pack's small files: ``$PKSAMPLER_CACHE`` (or ~/.cache/pksampler)/objectstore/."""
        base = Path(os.environ.get("PKSAMPLER_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                                Path.home() / ".cache") / "pksampler")
        digest = hashlib.sha256(self.identity().encode()).hexdigest()[:16]
        return base / "objectstore" / f"{self.bucket}-{digest}"

    def fetch(self, name: str, folder: Path) -> Path:
        """``prefix/name`` downloaded atomically into ``folder`` (kept; the caller checks it against the manifest)."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        atomic_write_bytes(path, self.get(name))
        return path


def _run(coroutine: Any) -> Any:
    """``asyncio.run(coroutine)``, in a thread of its own when this thread already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


async def _get_if_match(client: Any, key: str, starts: list[int], ends: list[int], etag: str) -> list[bytes]:
    """The byte runs ``[starts[i], ends[i])`` of ``key``, fetched in parallel, each GET carrying ``If-Match``."""
    import obstore

    async def one(start: int, end: int) -> bytes:
        result = await obstore.get_async(client, key, options={"range": (start, end), "if_match": etag})
        return bytes(await result.bytes_async())

    return list(await asyncio.gather(*(one(start, end) for start, end in zip(starts, ends))))
