"""The environment scripts/setup.sh builds: the interpreter's venv, the extras, torch kept as installed."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch import ROOT

SETUP = ROOT / "scripts" / "setup.sh"
TORCH_VERSION = "2.13.0"


def _print_venv(**env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PKSAMPLER_VENV")}
    return subprocess.run(["bash", str(SETUP), "--print-venv"], env={**full, **env},
                          capture_output=True, text=True, timeout=60)


def test_each_python_version_gets_its_own_venv():
    version = "%d.%d" % sys.version_info[:2]
    result = _print_venv(PYTHON=sys.executable)
    assert result.returncode == 0, result.stderr
    expected = ROOT / (".venv" if version == "3.11" else f".venv-{version}")
    assert Path(result.stdout.strip()) == expected
    default = _print_venv()
    assert default.returncode == 0, default.stderr
    assert Path(default.stdout.strip()) == ROOT / ".venv"
    chosen = _print_venv(PYTHON=sys.executable, PKSAMPLER_VENV="/tmp/elsewhere")
    assert chosen.stdout.strip() == "/tmp/elsewhere"


def test_this_interpreter_runs_in_the_venv_setup_made_for_it():
    """The suite runs under the venv setup.sh picks for this Python (the stamp proves setup finished there)."""
    venv = Path(sys.prefix)
    stamp = venv / ".pksampler-setup-stamp"
    assert stamp.is_file(), f"{venv} was not made by scripts/setup.sh"
    assert (venv / ".gitignore").read_text().strip() == "*"


def test_an_unknown_interpreter_is_a_clear_error():
    result = _print_venv(PYTHON="python3.99")
    assert result.returncode != 0
    assert "PYTHON=python3.99: no such interpreter" in result.stderr


def test_extras_are_declared_and_installed_without_replacing_torch():
    import torch

    extras = importlib.metadata.metadata("pksampler").get_all("Provides-Extra")
    assert {"horovod", "tensorboard", "pml", "frameworks", "dev"} <= set(extras)
    requires = importlib.metadata.requires("pksampler") or []
    assert any(r.startswith("matplotlib") and "extra" not in r for r in requires)
    for package in ("tensorboard", "pytorch-metric-learning", "webdataset", "lightning", "accelerate", "torchdata",
                    "pytorch-ignite", "datasets", "pyarrow"):
        assert any(r.startswith(package) and 'extra == "dev"' in r for r in requires), package
        importlib.metadata.version(package)  # installed
    assert torch.__version__.split("+")[0] == TORCH_VERSION


def test_the_installed_packages_are_consistent():
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_pytorch_metric_learning_is_imported_only_for_pml_losses(tmp_path):
    code = ("import sys, pksampler.train.losses.pair as L; print('pytorch_metric_learning' in sys.modules);"
            "L.build_loss('pml.ContrastiveLoss', {}); print('pytorch_metric_learning' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_horovod_runner_starts_without_distutils_on_python_312(tmp_path):
    """Python 3.12 has no distutils: setup.sh patches Horovod's runner to use shutil.which.

    setuptools' distutils shim would hide a missing patch, so it is blocked
    here. Before 3.12 the standard library still has distutils (and the
    cached 3.11 wheel may predate the patch), so only the import is checked.
    """
    block = "sys.modules['distutils'] = None; sys.modules['distutils.spawn'] = None;"
    code = (f"import sys; {block if sys.version_info >= (3, 12) else ''}"
            "import horovod.runner.launch, horovod.runner.js_run as j; print(j.find_executable('sh'))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("/sh")


def test_lightning_imports_and_the_frameworks_recipe_runs_in_the_environment_as_set_up(tmp_path):
    """Before: the dev extra's torchvision wheel, which cannot load against the CPU torch, failed ``import
    lightning`` (``operator torchvision::nms does not exist``) and the suite worked around it."""
    page = (ROOT / "docs" / "frameworks.md").read_text(encoding="utf-8")
    recipe = next(code for code in re.findall(r"```python\n(.*?)```", page, flags=re.S) if "import lightning" in code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a fresh interpreter: nothing of the suite
    result = subprocess.run([sys.executable, "-c", recipe], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # the parity tests' reference code lives outside site-packages: a fresh interpreter finds neither package (this
    # one may have the reference folder on sys.path, from a parity test earlier in the run)
    probe = ("import importlib.metadata as m\n"
             "for name in ('torchvision', 'timm'):\n"
             "    try:\n        print(name, m.version(name))\n"
             "    except m.PackageNotFoundError:\n        print(name, 'absent')\n")
    found = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert found.stdout.split() == ["torchvision", "absent", "timm", "absent"], found.stdout + found.stderr
    reference = Path(sys.prefix) / "reference"
    assert (reference / "torchvision" / "torchvision" / "ops" / "misc.py").is_file()
    assert (reference / "timm" / "timm" / "__init__.py").is_file()


@pytest.mark.parametrize("present", [(), ("torchvision",)])
def test_the_parity_tests_fail_in_one_line_naming_the_set_up_when_their_reference_code_is_missing(tmp_path, present):
    """The parity tests never skip: without the reference code they fail naming scripts/setup.sh. Before: with
    torchvision's code there and timm's missing, the error was Python's own "No module named 'timm'"."""
    reference = tmp_path / "reference"
    reference.mkdir()
    for package in present:
        (reference / package).symlink_to(Path(sys.prefix) / "reference" / package)
    code = ("import sys, pathlib; sys.path.insert(0, 'tests'); import reference_models as r; "
            f"r.REFERENCE = pathlib.Path({str(reference)!r}); r.import_timm()")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    missing = "timm" if present else "torchvision"
    assert re.fullmatch(rf"ImportError: {missing}'s code is in neither the environment nor .*: run "
                        r"\./scripts/setup\.sh", last), result.stderr[-2000:]


TEST_SH = ROOT / "scripts" / "test.sh"


def _test_sh(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "PKSAMPLER_TEST_WORKERS"}
    return subprocess.run(["bash", str(TEST_SH), *args], env={**full, **env}, capture_output=True, text=True,
                          timeout=300)


def test_test_sh_byte_compiles_every_folder_of_the_import_namespace():
    """Every folder pyproject.toml maps into ``pksampler`` is byte-compiled before the suite, so no launched rank
    compiles it from source; samplers/ and datasets/ (29 of the ~125 modules) were left out."""
    import tomllib

    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    line, = [line for line in TEST_SH.read_text().splitlines() if " -m compileall " in line]
    named = set(line.split(" -m compileall ")[1].split(">")[0].split()) - {"-q"}
    assert folders <= named, f"not byte-compiled: {sorted(folders - named)}"
    assert all((ROOT / folder).is_dir() for folder in named)


def test_a_cost_record_that_cannot_be_written_stops_the_session_in_one_line_before_any_test(tmp_path):
    """``PKSAMPLER_TEST_COST`` in a missing folder: pytest's usage error naming it, no test run; before, the first
    test ran and the session ended in an INTERNALERROR traceback."""
    target = tmp_path / "absent" / "cost.jsonl"
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "tests/core/test_hashing.py",
                             "-k", "splitmix"], cwd=ROOT, env={**os.environ, "PKSAMPLER_TEST_COST": str(target)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip() == (f"ERROR: PKSAMPLER_TEST_COST={target}: cannot be appended to (No such file or "
                                     "directory): name a file in a writable folder, or unset it")
    assert "passed" not in result.stdout and not target.parent.exists()


def test_the_files_run_longest_first_then_launching_then_in_process_longest_first_each_file_whole_and_in_order():
    """A file with one launched test among in-process ones (tests/packaging/test_environment.py,
    test_clip_grad_norm.py, test_block_cache_safety.py, catalogue/test_sources.py) was cut in two, its launched
    tests run apart from the rest: in one process, a module fixture they share was set up twice."""
    from file_order import IN_PROCESS_LONGEST_FIRST, LONGEST_FIRST, in_file_order

    class Item:
        def __init__(self, nodeid: str, launches: bool) -> None:
            self.nodeid, self.launches = nodeid, launches

        def get_closest_marker(self, name: str) -> object:
            return name == "launcher" and self.launches or None

    collected = [Item("tests/a/test_mixed.py::in_process_1", False), Item("tests/a/test_mixed.py::launched", True),
                 Item("tests/a/test_mixed.py::in_process_2", False), Item("tests/b/test_plain.py::one", False),
                 Item(f"tests/{LONGEST_FIRST[1]}::x", True), Item("tests/c/test_launched.py::y", True),
                 Item(f"tests/{LONGEST_FIRST[0]}::z", True), Item(f"tests/{IN_PROCESS_LONGEST_FIRST[0]}::w", False)]
    assert [item.nodeid.rsplit("/", 1)[1] for item in in_file_order(collected)] == [
        f"{LONGEST_FIRST[0].rsplit('/', 1)[1]}::z", f"{LONGEST_FIRST[1].rsplit('/', 1)[1]}::x",
        "test_mixed.py::in_process_1", "test_mixed.py::launched", "test_mixed.py::in_process_2",
        "test_launched.py::y", f"{IN_PROCESS_LONGEST_FIRST[0].rsplit('/', 1)[-1]}::w", "test_plain.py::one"]
    # a renamed file would drop out
    assert all((ROOT / "tests" / path).is_file() for path in (*LONGEST_FIRST, *IN_PROCESS_LONGEST_FIRST))


def test_a_file_whose_launched_tests_are_deselected_is_ordered_as_in_process():
    """``make test-fast`` (-m "not launcher"): the order is taken after -m deselects, so test_environment.py, whose
    one launched test is left out, runs after test_readme.py as IN_PROCESS_LONGEST_FIRST says, not before it among
    the launching files."""
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "--collect-only", "-q", "-m",
                             "not launcher", "tests/packaging/test_environment.py", "tests/test_readme.py"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    files = list(dict.fromkeys(line.split("::")[0] for line in result.stdout.splitlines() if "::" in line))
    assert files == ["tests/test_readme.py", "tests/packaging/test_environment.py"], files


@pytest.mark.parametrize("workers", ["junk", "-1", "2x", " "])
def test_test_sh_refuses_a_worker_count_that_is_not_a_whole_number_in_one_line(workers):
    result = _test_sh("tests/core/test_hashing.py", PKSAMPLER_TEST_WORKERS=workers)
    assert result.returncode == 2 and "passed" not in result.stdout
    assert result.stderr.strip() == (f"PKSAMPLER_TEST_WORKERS={workers}: must be a whole number of xdist workers "
                                     "(0: none, one process)")


@pytest.mark.launcher  # two nested pytest sessions through the script (~30 s): not the edit loop's tier
def test_test_sh_runs_in_one_process_when_xdist_is_off_and_in_workers_otherwise():
    """``-p no:xdist`` (pdb, -s) was passed on beside ``-n 2``, which pytest then refused as unknown."""
    for args, workers, spread in ((("-p", "no:xdist"), "2", False), ((), "1", True)):
        result = _test_sh(*args, "tests/core/test_hashing.py", "-q", "-k", "splitmix", PKSAMPLER_TEST_WORKERS=workers)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert re.search(r"\b1 passed\b", result.stdout), result.stdout[-2000:]
        assert ("bringing up nodes" in result.stdout) == spread, (args, workers, result.stdout[-2000:])
