"""Imports run one way: library <- loop <- application, with no cycle between modules.

The source folders are read as text and walked as ASTs (nothing is
imported), every ``import`` counted: module level and function-local ones,
relative ones resolved against the module's package. Only imports under
``if TYPE_CHECKING:`` are left out, because they never execute (they name
types for annotations).

Layers:

* library: ``pksampler`` (core), ``pksampler.samplers``, ``pksampler.datasets``;
  never imports ``pksampler.train``;
* the trainer's sub-packages, each importing only those below it
  (:data:`ALLOWED`): ``errors`` < ``config`` < ``modeling`` < ``losses`` (the head's
  loss builds its head), ``runtime`` < ``solver``, ``evaluation`` < ``engine`` (its
  ``elastic`` package included); ``solver`` is a leaf under ``engine``, as in detectron2
  (no hook lives there);
* application: ``train/run_setup.py`` (``train``/``main``), the builders, the
  registry of choices in the package's ``__init__`` and the script, on top;
* the catalogue (``train/catalogue/``: export, embed, index, query, and its
  scripts beside the trainer's): application too, beside ``run_setup``; it may
  import every role and the builders, and nothing imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from launch import ROOT

#: package name -> source folder (pyproject.toml's package-dir)
SUBPACKAGES = ("config", "engine", "evaluation", "losses", "modeling", "runtime", "solver", "catalogue")
PACKAGES = {
    "pksampler": ROOT / "pksampler",
    "pksampler.samplers": ROOT / "samplers",
    "pksampler.datasets": ROOT / "datasets",
    "pksampler.train": ROOT / "train",
    **{f"pksampler.train.{name}": ROOT / "train" / name for name in SUBPACKAGES},
    "pksampler.train.engine.elastic": ROOT / "train" / "engine" / "elastic",
}
LIBRARY = ("pksampler.samplers", "pksampler.datasets")
APPLICATION = {"pksampler.train", "pksampler.train.run_setup", "pksampler.train.builders", "pksampler.train.retrieval"}
#: the catalogue's scripts (train/*.py beside retrieval.py) and its package: application, imported by nothing
CATALOGUE_SCRIPTS = {f"pksampler.train.{name}" for name in ("export_model", "embed_catalogue", "build_index",
                                                            "query_catalogue")}
CATALOGUE = "pksampler.train.catalogue"
#: trainer role -> the roles it may import (besides itself and the library); the application may import all
ALLOWED = {
    "errors": set(),
    "config": {"errors"},
    "modeling": {"errors", "config"},
    "losses": {"errors", "config", "modeling"},
    "runtime": {"errors", "config"},
    "evaluation": {"errors", "config", "runtime"},
    "engine": {"errors", "config", "runtime", "losses", "modeling", "evaluation", "solver"},
    "solver": {"errors", "config", "modeling"},
}


def role(module: str) -> str | None:
    """The trainer role of a module (``pksampler.train.engine.hooks`` -> ``engine``); None outside the roles."""
    parts = module.split(".")
    if module in APPLICATION or parts[:2] != ["pksampler", "train"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in ALLOWED else None


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``), for every source file of the packages."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = (path, path.stem == "__init__")
    return found


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The internal modules that ``name`` imports (a ``from p import m`` of a submodule counts as ``p.m``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            targets.add(submodule if submodule in known else base)
    return {t for t in targets if t in known or t.startswith("pksampler.")}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, is_package, known) - {name} for name, (path, is_package) in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_walk_sees_every_package_and_local_and_relative_imports():
    graph = import_graph()
    assert {"pksampler", "pksampler.samplers.triplet", "pksampler.datasets.folder", "pksampler.train.engine.trainer"} <= set(graph)
    assert "pksampler.train.engine.trainer" in graph["pksampler.train.engine.hooks"]  # relative, module level
    assert "pksampler.train.run_setup" in graph["pksampler.train"]  # function-local, in the package __init__
    assert "pksampler.train.run_setup" in graph["pksampler.train.retrieval"]  # absolute, function-local


def test_every_source_package_is_walked():
    """A sub-package added or moved (``engine/elastic/``) is in :data:`PACKAGES`, so its imports are checked."""
    folders = {path.parent for root in (ROOT / "pksampler", ROOT / "samplers", ROOT / "datasets", ROOT / "train")
               for path in root.rglob("__init__.py")}
    assert folders <= set(PACKAGES.values()), sorted(map(str, folders - set(PACKAGES.values())))
    graph = import_graph()
    assert {"pksampler.train.engine.elastic.run", "pksampler.train.engine.elastic.handlers",
            "pksampler.train.engine.elastic.commit", "pksampler.train.engine.mode",
            "pksampler.train.engine.writers", "pksampler.world"} <= set(graph)
    assert role("pksampler.train.engine.elastic.run") == "engine"


def test_the_solver_is_a_leaf_that_imports_no_loop():
    graph = import_graph()
    solver = {name: sorted(t for t in targets if role(t) == "engine")
              for name, targets in graph.items() if role(name) == "solver"}
    assert solver and not {k: v for k, v in solver.items() if v}, solver


def test_the_library_never_imports_the_trainer():
    core = {name for name, (path, _) in modules().items() if path.parent == PACKAGES["pksampler"]}
    offenders = {name: sorted(t for t in targets if t == "pksampler.train" or t.startswith("pksampler.train."))
                 for name, targets in import_graph().items() if name in core or name.startswith(LIBRARY)}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_each_role_imports_only_the_roles_below_it():
    offenders = {}
    for name, targets in import_graph().items():
        own = role(name)
        if own is None:
            continue
        bad = sorted(t for t in targets if t.startswith("pksampler.train")
                     and (t in APPLICATION or (role(t) not in ALLOWED[own] | {own})))
        if bad:
            offenders[name] = bad
    assert not offenders, offenders


def _in_catalogue(module: str) -> bool:
    return module in CATALOGUE_SCRIPTS or module == CATALOGUE or module.startswith(CATALOGUE + ".")


def test_the_catalogue_is_application_that_nothing_imports():
    graph = import_graph()
    assert CATALOGUE_SCRIPTS | {f"{CATALOGUE}.embed", f"{CATALOGUE}.index"} <= set(graph)
    assert f"{CATALOGUE}.cli" in graph["pksampler.train.embed_catalogue"]  # the script runs the package
    importers = {name: sorted(t for t in targets if _in_catalogue(t))
                 for name, targets in graph.items() if not _in_catalogue(name)}
    assert not {k: v for k, v in importers.items() if v}, importers
    # it imports the roles and the builders, never the trainer's application (run_setup, the script)
    reaching = {name: sorted(t for t in targets if t in {"pksampler.train.run_setup", "pksampler.train.retrieval"})
                for name, targets in graph.items() if _in_catalogue(name)}
    assert not {k: v for k, v in reaching.items() if v}, reaching


def test_the_configuration_imports_neither_models_nor_datasets():
    """Validating a YAML file loads no model, loss, dataset or sampler code: their names come from above."""
    graph = import_graph()
    config = [name for name in graph if role(name) == "config"]
    assert config
    offenders = {name: sorted(t for t in graph[name] if t.startswith(("pksampler.datasets", "pksampler.train.modeling",
                                                                    "pksampler.train.losses")))
                 for name in config}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_no_import_cycle_between_modules():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


@pytest.mark.parametrize(("graph", "expected"), [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert find_cycle(graph) == expected


def test_a_function_local_import_cycle_is_caught(tmp_path):
    (tmp_path / "one.py").write_text("def f():\n    from .two import g\n")
    (tmp_path / "two.py").write_text("from .one import f\nfrom typing import TYPE_CHECKING\n"
                                     "if TYPE_CHECKING:\n    from . import three\n")
    known = {"pkg.one", "pkg.two", "pkg.three"}
    graph = {name: imports_of(name, tmp_path / f"{name.split('.')[1]}.py", False, known) for name in ("pkg.one", "pkg.two")}
    assert graph == {"pkg.one": {"pkg.two"}, "pkg.two": {"pkg.one"}}
    assert find_cycle(graph) == ["pkg.one", "pkg.two", "pkg.one"]
