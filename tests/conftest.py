"""Shared test set-up: make the helper modules in tests/ importable."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from pksampler.comm import LAUNCHER_ENVIRONMENT  # noqa: E402

# Tests must not pick up a launcher's rank from the environment they run in.
for _keys in LAUNCHER_ENVIRONMENT:
    for _key in _keys:
        os.environ.pop(_key, None)

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from file_order import in_file_order  # noqa: E402

settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark ``launcher`` every test that starts a launcher or a server, so ``-m "not launcher"`` (``make
    test-fast``) is the edit loop's tier: the ``horovod`` tests (real ranks under horovodrun or torchrun) and
    the tests on the S3 server (the ``seaweed`` fixture, directly or through another fixture). The frameworks'
    launches carry the mark in their module."""
    for item in items:
        if item.get_closest_marker("horovod") or "seaweed" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.launcher)


class _FileOrder:
    """Orders the files (tests/file_order.py) once -m has deselected: a file whose launched tests are left out
    (``make test-fast``) is placed as the in-process file it then is. scripts/test.sh keeps this order in the xdist
    workers (--no-loadscope-reorder)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items[:] = in_file_order(items)


@pytest.fixture(autouse=True)
def _end_the_tests_launches():
    """End every launch a test started and left running (a failed assertion between start and finish): the next
    test starts on a quiet machine. Launches of module- and session-scoped fixtures started before it and stay,
    and so does a session's server that a test restarted (``spawn(outlives_test=True)``)."""
    import launch

    before = {process.pid for process in launch.test_launches()}
    yield
    for process in launch.test_launches():
        if process.pid not in before:
            launch.end_launch(process)


#: launches counted by pytest-xdist's workers (``-n``), added up by the controller as each worker ends
_WORKER_LAUNCHES: collections.Counter[str] = collections.Counter()


def pytest_sessionfinish(session):
    """In an xdist worker: hand this worker's launch count to the controller (``workeroutput``)."""
    launch = sys.modules.get("launch")
    if hasattr(session.config, "workeroutput") and launch is not None:
        session.config.workeroutput["launches"] = dict(launch.LAUNCHES)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without xdist (-p no:xdist) it is never called
def pytest_testnodedown(node, error):
    """In the xdist controller: add up the launches of a worker that ended."""
    _WORKER_LAUNCHES.update(getattr(node, "workeroutput", {}).get("launches", {}))


def pytest_terminal_summary(terminalreporter):
    """The number of launches (horovodrun, torchrun, the frameworks' launchers, the S3 server) this run started,
    over every xdist worker."""
    launch = sys.modules.get("launch")
    launches = collections.Counter(_WORKER_LAUNCHES)
    if launch is not None:
        launches.update(launch.LAUNCHES)
    if launches:
        kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(launches.items()))
        terminalreporter.write_line(f"launches: {sum(launches.values())} ({kinds})")


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A real SeaweedFS S3 server on 127.0.0.1 for the session (tests/objectstore_server.py)."""
    from objectstore_server import SeaweedServer

    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


_REFERENCE_PACKAGES = ("torchvision", "timm")


@pytest.fixture(autouse=True, scope="module")
def _forget_reference_packages():
    """A test module that imported the parity tests' reference code (tests/reference_models.py registers
    torchvision's files bare, and timm from a folder it adds to sys.path) leaves no trace of it for the next: Lightning, imported by a later
    module in the same interpreter, would take the bare torchvision for an installed one and fail to import."""
    before, path = {name for name in sys.modules if name.split(".")[0] in _REFERENCE_PACKAGES}, list(sys.path)
    yield
    for name in [n for n in sys.modules if n.split(".")[0] in _REFERENCE_PACKAGES and n not in before]:
        del sys.modules[name]
    sys.path[:] = path  # the reference folder tests/reference_models.py put on it


def _children_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _own_cpu() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pytest_configure(config):
    """Registers the file order (:class:`_FileOrder`). ``PKSAMPLER_TEST_COST`` must name a file this process can
    append to: checked once, before any test runs (a usage error in one line, not an internal error that ends the
    session after its first test)."""
    config.pluginmanager.register(_FileOrder(), "pksampler-file-order")
    target = os.environ.get("PKSAMPLER_TEST_COST")
    if target:
        try:
            with open(target, "a", encoding="utf-8"):
                pass
        except OSError as error:
            raise pytest.UsageError(f"PKSAMPLER_TEST_COST={target}: cannot be appended to ({error.strerror}): "
                                    "name a file in a writable folder, or unset it") from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``PKSAMPLER_TEST_COST=file``: append each test's wall time and CPU time (this process's and its
    launches', set-up of shared fixtures included) as one JSON line, the suite's cost per file and per test."""
    target = os.environ.get("PKSAMPLER_TEST_COST")
    if not target:
        yield
        return
    import json
    import time

    wall, own, children = time.monotonic(), _own_cpu(), _children_cpu()
    yield
    record = {"test": item.nodeid, "wall": round(time.monotonic() - wall, 3), "own": round(_own_cpu() - own, 3),
              "launched": round(_children_cpu() - children, 3)}
    with open(target, "a", encoding="utf-8") as stream:
        stream.write(json.dumps(record) + "\n")
