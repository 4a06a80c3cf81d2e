"""The order the suite's files run in (tests/conftest.py sorts the collected tests with :func:`in_file_order`).

scripts/test.sh keeps it in the xdist workers (``--no-loadscope-reorder``), which take a file at a time.
"""

from __future__ import annotations

from typing import Any, Sequence

#: the files that take longest (wall time, measured with PKSAMPLER_TEST_COST), run first, longest first: the two
#: xdist workers then end on short files, not one worker on a long launch while the other waits (pytest-xdist's
#: default order, most tests first, started the 16-rank command last)
LONGEST_FIRST = ("distributed/test_default_command.py", "distributed/test_elastic.py",
                 "distributed/test_global_neck.py", "distributed/test_trainer.py", "distributed/test_nodes.py",
                 "test_catalogue_walkthrough.py", "test_catalogue_growth_walkthrough.py",
                 "distributed/test_trainer_errors.py", "distributed/test_platform.py",
                 "distributed/test_torchrun_faults.py")


#: the in-process files that take longest, first among the in-process ones (`make test-fast` is made of these; a
#: file whose launched tests are deselected counts as in-process): the docs' blocks, each a process of its own, ended
#: the tier on one worker while the other had finished
IN_PROCESS_LONGEST_FIRST = ("test_readme.py", "packaging/test_environment.py", "benchmarks/test_gpu_acceptance.py",
                            "train/engine/test_cached_step.py", "datasets/test_sharded.py",
                            "train/modeling/test_backbones.py")


def _file(item: Any) -> str:
    return item.nodeid.split("::")[0].removeprefix("tests/")


def in_file_order(items: Sequence[Any]) -> list[Any]:
    """``items`` (collected tests, ``launcher`` marks set) by file: LONGEST_FIRST, then the other files with a test
    that launches, then the in-process ones (IN_PROCESS_LONGEST_FIRST first; the short rest fill the end). A file is
    placed whole, so its tests stay together and in their order (a module-scoped fixture is set up once even in one
    process)."""
    launching = {_file(item) for item in items if item.get_closest_marker("launcher")}

    def place(item: Any) -> tuple[int, int]:
        path = _file(item)
        if path in LONGEST_FIRST:
            return (0, LONGEST_FIRST.index(path))
        if path in launching:
            return (1, 0)
        return (2, IN_PROCESS_LONGEST_FIRST.index(path)) if path in IN_PROCESS_LONGEST_FIRST else (3, 0)

    return sorted(items, key=place)
