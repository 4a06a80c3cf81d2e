"""Whether a location is an object store is decided in one place (pksampler/locations.py), by every reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launch import ROOT

from pksampler.datasets.objectstore import split_url
from pksampler.locations import OBJECT_STORE_SCHEME, is_remote
from pksampler.train.catalogue.sources import source_kind

SOURCES = ("pksampler", "samplers", "datasets", "train")


@pytest.mark.parametrize(("location", "remote"), [
    ("s3://bucket/prefix", True), ("s3://b", True), ("S3://bucket", False), ("/data/s3://x", False),
    ("bucket/prefix", False), ("", False), (None, False), (Path("s3:/bucket"), False), (b"s3://bucket", False),
])
def test_is_remote_is_a_string_starting_with_the_scheme(location, remote):
    assert is_remote(location) is remote


def test_the_readers_agree_with_it():
    assert source_kind("s3://bucket/catalogue") == "shards"  # no folder is looked for
    assert split_url(f"{OBJECT_STORE_SCHEME}bucket/some/prefix/") == ("bucket", "some/prefix")
    for bad in ("s3:///x", "s3://", "http://bucket/x", "/bucket/x"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            split_url(bad)


def test_the_scheme_is_tested_in_one_module():
    tests = sorted(str(path.relative_to(ROOT)) for folder in SOURCES for path in (ROOT / folder).rglob("*.py")
                   if re.search(r"""startswith\(\s*["']s3:""", path.read_text(encoding="utf-8")))
    assert tests == [], tests  # each reader asks is_remote
    assert "startswith(OBJECT_STORE_SCHEME)" in (ROOT / "pksampler" / "locations.py").read_text(encoding="utf-8")
