"""The workspace's lock file: a planted link is refused in one line, never written through."""

from __future__ import annotations

import os

import pytest

from pksampler.train.errors import ConfigError
from pksampler.train.runtime.workspace import WorkspaceLock


def test_a_link_in_place_of_the_workspace_lock_is_refused_and_its_target_kept(tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("precious\n")
    workspace = tmp_path / "run"
    workspace.mkdir()
    os.symlink(victim, workspace / ".lock")
    with pytest.raises(ConfigError, match=r"^workspace: .*/run/\.lock is a symbolic link, not a regular file: it "
                                          r"cannot be used as a lock file; remove it$"):
        WorkspaceLock(workspace).acquire()
    assert victim.read_text() == "precious\n"
    os.unlink(workspace / ".lock")
    lock = WorkspaceLock(workspace)
    lock.acquire()  # the ordinary file it then creates is taken as before
    assert lock.held
    lock.release()
