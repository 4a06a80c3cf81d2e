"""Where data lives: a local path or an object-store URL, told apart in one place.

The trainer's configuration check, its data builders, the catalogue's source
reader and the object-store client all ask "is this location on an object
store?"; they ask :func:`is_remote`, so the scheme is written once. It is a
pure string test (nothing is imported or contacted), cheap enough for the
configuration layer, which loads no dataset code.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OBJECT_STORE_SCHEME", "is_remote"]

#: the prefix of an object-store location: ``s3://bucket/prefix`` (any S3-compatible store)
OBJECT_STORE_SCHEME = "s3://"


def is_remote(location: Any) -> bool:
    """Whether ``location`` names an object store (a ``str`` starting with ``s3://``); paths never do."""
    return isinstance(location, str) and location.startswith(OBJECT_STORE_SCHEME)
