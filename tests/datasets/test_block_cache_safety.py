"""The block cache on a shared host (SeaweedFS on 127.0.0.1): it deletes only its own blocks, never trusts a
planted link or a folder others may write, and never serves one pack's bytes for another's."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest

from pksampler.datasets import ShardedDataset
from pksampler.datasets.blockcache import BLOCKS_FOLDER, BlockCache
from synthetic_pack import synthetic_pack, uploaded

BLOCK = 64 << 10


@pytest.fixture(scope="module")
def local_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("cachesafety")
    return synthetic_pack(root / "folder", root / "shards", num_classes=12, images_per_class=6, image_size=48,
                          shard_size="200KB")


@pytest.fixture(scope="module")
def remote_pack(local_pack, seaweed):
    return uploaded(local_pack, seaweed, "s3://pksampler-test/packs/safety")


@pytest.fixture(autouse=True)
def node_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PKSAMPLER_CACHE", str(tmp_path / "cache"))


def every_sample(dataset: ShardedDataset) -> list[bytes]:
    return [dataset.read_bytes(i) for i in range(len(dataset))]


def test_eviction_deletes_only_the_caches_own_blocks(local_pack, remote_pack, tmp_path):
    # The cache used to list every regular file of cache_dir and delete the oldest: a user's files too.
    folder = tmp_path / "home-cache"
    folder.mkdir()
    mine = {folder / f"notes-{i}.txt": os.urandom(BLOCK) for i in range(5)}
    mine[folder / "shard-000000.tar.0123456789ab.0000000"] = b"looks like a block, but in the user's folder"
    for path, data in mine.items():
        path.write_bytes(data)
        os.utime(path, (0, 0))  # older than any block: the first to go under an LRU over the whole folder
    remote = ShardedDataset(remote_pack, block_cache=3 * BLOCK, block_size=BLOCK, cache_dir=folder)
    assert every_sample(remote) == every_sample(ShardedDataset(local_pack))
    assert {path: path.read_bytes() for path in mine} == mine
    assert remote.blocks.folder == folder / BLOCKS_FOLDER
    assert 0 < remote.blocks.usage()[1] <= 5 * BLOCK
    assert os.stat(folder / BLOCKS_FOLDER).st_mode & 0o777 == 0o700


def test_planted_links_and_foreign_folders_are_refused_or_fetched_over(local_pack, remote_pack, tmp_path):
    local = ShardedDataset(local_pack)
    # a blocks folder that others may write is refused, naming it and the rule
    open_folder = tmp_path / "open"
    (open_folder / BLOCKS_FOLDER).mkdir(parents=True)
    os.chmod(open_folder / BLOCKS_FOLDER, 0o777)
    with pytest.raises(PermissionError, match=rf"{BLOCKS_FOLDER} has mode 0777: group or others may write it"):
        ShardedDataset(remote_pack, block_cache=4 * BLOCK, block_size=BLOCK, cache_dir=open_folder)
    # a link planted at a block's name is not served: the block is fetched over it
    remote = ShardedDataset(remote_pack, block_cache=64 * BLOCK, block_size=BLOCK, cache_dir=tmp_path / "planted")
    name = f"{remote.shard_names[0]}.{remote._shard_version(0, remote._shard_etag(0))}.{0:07d}"
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"\0" * min(BLOCK, int(remote.shard_bytes[0])))
    (remote.blocks.folder / name).symlink_to(decoy)
    assert remote.read_bytes(0) == local.read_bytes(0)
    assert not (remote.blocks.folder / name).is_symlink() and decoy.read_bytes().count(0) == decoy.stat().st_size
    # links at the lock files would create files outside the cache: refused in one line, nothing created there
    locks = tmp_path / "links" / BLOCKS_FOLDER / "locks"
    outside = tmp_path / "outside"
    outside.mkdir()
    BlockCache(tmp_path / "links", limit_bytes=4 * BLOCK, block_bytes=BLOCK)
    for stripe in range(256):
        (locks / f"{stripe:03d}.lock").symlink_to(outside / f"{stripe:03d}")
    linked = ShardedDataset(remote_pack, block_cache=4 * BLOCK, block_size=BLOCK, cache_dir=tmp_path / "links")
    with pytest.raises(OSError, match=r"lock file .*\.lock is a link, a special file or one file under several names"):
        linked.read_bytes(0)
    assert list(outside.iterdir()) == []
    # two stripes that are one file (hard links) used to make a reader wait for itself forever
    shutil.rmtree(locks)
    locks.mkdir(mode=0o700)
    (locks / "000.lock").write_bytes(b"")
    for stripe in range(1, 256):
        os.link(locks / "000.lock", locks / f"{stripe:03d}.lock")
    outcome: list[BaseException | bytes] = []

    def read() -> None:
        try:
            outcome.append(linked.read_bytes(0))
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            outcome.append(error)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=120)  # a deadline for a hang, not a wait for readiness: the answer comes at once
    assert outcome and isinstance(outcome[0], OSError), "the reader hung on two lock stripes that are one file"
    assert "one file under several names" in str(outcome[0])


def test_two_packs_in_one_cache_dir_never_share_blocks(local_pack, seaweed, tmp_path):
    # Two packs whose manifests carry no shard digests and whose shards have equal names and sizes: blocks were
    # keyed by the manifest entry alone, so pack B was served pack A's bytes.
    packs = {}
    for name, flip in (("a", 0), ("b", 0x5A)):
        copy = tmp_path / name
        shutil.copytree(local_pack, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        for entry in manifest["shards"]:
            entry.pop("fingerprint", None)
            entry.pop("sha256", None)
            path = copy / entry["name"]
            data = np.frombuffer(path.read_bytes(), dtype=np.uint8) ^ np.uint8(flip)
            path.write_bytes(data.tobytes())
        (copy / "manifest.json").write_text(json.dumps(manifest))
        packs[name] = (copy, uploaded(copy, seaweed, f"s3://pksampler-test/packs/twin-{name}"))
    for name, (copy, url) in packs.items():
        remote = ShardedDataset(url, block_cache=64 * BLOCK, block_size=BLOCK, cache_dir=tmp_path / "shared")
        want = [hashlib.sha256((copy / remote.shard_names[int(r["shard"])]).read_bytes()
                               [int(r["offset"]):int(r["offset"]) + int(r["size"])]).digest() for r in remote.index]
        assert [hashlib.sha256(data).digest() for data in every_sample(remote)] == want, f"pack {name}"


def test_a_full_read_only_or_vanished_cache_folder_serves_uncached_with_one_warning(local_pack, remote_pack,
                                                                                       seaweed, tmp_path):
    # ENOSPC, EROFS and a folder deleted mid-run were tracebacks on every rank. Real tmpfs mounts, in a mount
    # namespace of the child's own (unshare -rm: no root needed, nothing left mounted).
    script = os.path.join(os.path.dirname(__file__), "cache_faults.py")
    done = subprocess.run(["unshare", "-rm", sys.executable, script, str(local_pack), remote_pack, str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **seaweed.environment()})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for case, errno_name in (("full", "ENOSPC"), ("readonly", "EROFS"), ("vanished", "ENOENT")):
        outcome = report[case]
        assert outcome["same"], case
        assert len(outcome["warnings"]) == 1, (case, outcome["warnings"])
        assert errno_name in outcome["warnings"][0] and "data.args.cache_dir" in outcome["warnings"][0], outcome
    assert report["vanished"]["locks_again"]  # what was deleted is there again


@pytest.mark.parametrize("below", ["", "sub"])
def test_a_cache_dir_that_is_a_file_or_under_one_is_refused_naming_cache_dir(tmp_path, below):
    file = tmp_path / "file"
    file.write_bytes(b"not a folder")
    folder = file / below if below else file
    with pytest.raises(NotADirectoryError) as caught:
        BlockCache(folder, limit_bytes=4 << 20, block_bytes=1 << 20)
    message = str(caught.value)
    assert "cache_dir" in message and str(folder) in message and "is a file or lies under one" in message
    assert "Errno" not in message
