"""README.md and docs/*.md say what the code does: snippets run as written, and nothing they name has drifted.

* every ```python block runs as written, as ``python snippet.py`` in a fresh process and an empty folder (the way a
  reader pastes it; a process of its own also keeps a snippet's DataLoader from forking a pytest worker whose other
  tests started threads, such as onnxruntime's);
* every ```yaml block that looks like a run config loads and validates as one;
* in every ```bash block, the files a command names (``--config``, scripts,
  benchmarks) exist and every ``--set key=...`` names a configuration key;
* every relative link points at a file that exists;
* docs/configuration.md is the generator's output (it cannot drift from the schema);
* README.md stays a front page (at most 400 lines).

A block that is not meant to run is fenced as ``text`` or ``console``.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hf_datasets import import_hf_datasets
from launch import ROOT

import pksampler.train  # noqa: F401  (registers the configuration's choice lists)
from pksampler.train.config.load import load_config
from pksampler.train.config.schema import RunConfig

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
import_hf_datasets()  # `from datasets import ...` in a snippet: Hugging Face's, not the repository's folder
#: config keys whose values are free-form mappings: any sub-key may follow them
FREE_FORM = {"data.args", "data.augment", "sampler.args", "loss.args", "loss.miner", "loss.memory"}
#: manual pages linked before their text is merged; a link to one may dangle only while the page is absent,
#: and each must be linked from docs/index.md (empty this set once the pages are on main)
FORTHCOMING: set[str] = set()  # pages linked before they exist (none now)


def blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def python_snippets() -> list[tuple[str, int, str]]:
    return [(_id(page), i, code) for page in PAGES for i, code in enumerate(blocks(page, "python"))]


@pytest.mark.parametrize(("page", "number", "code"), python_snippets(), ids=lambda v: v if isinstance(v, str) and
                         v.endswith(".md") else None)
def test_python_snippets_run_as_written(page, number, code, tmp_path):
    (tmp_path / "snippet.py").write_text(code, encoding="utf-8")
    done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page} python block {number} failed:\n{done.stdout}\n{done.stderr}"


def test_the_quick_start_is_on_the_front_page():
    assert any("DistributedBalancedSampler(" in code for code in blocks(ROOT / "README.md", "python"))


def _config_key(dotted: str) -> bool:
    """Whether ``dotted`` names a key of the run configuration (or lies under a free-form mapping)."""
    if any(dotted == free or dotted.startswith(free + ".") for free in FREE_FORM):
        return True
    node: object = RunConfig()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def test_the_key_check_itself_tells_keys_from_typos():
    assert _config_key("train.epochs") and _config_key("sampler.args.small_classes") and _config_key("seed")
    assert not _config_key("train.epoch") and not _config_key("model.backbone.depth")


def bash_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for block in blocks(page, "bash"):
            text = re.sub(r"\\\n\s*", " ", block)
            for line in text.splitlines():
                line = line.split(" #", 1)[0].strip()
                if line and not line.startswith("#") and "<<" not in line:
                    found.append((_id(page), shlex.split(line, comments=True)))
    return found


def test_bash_snippets_name_files_that_exist_and_keys_that_exist():
    problems = []
    for page, words in bash_commands():
        for i, word in enumerate(words):
            if word == "--config" and i + 1 < len(words) and not (ROOT / words[i + 1]).is_file():
                problems.append(f"{page}: --config {words[i + 1]} does not exist")
            if word == "--set" and i + 1 < len(words):
                key = words[i + 1].split("=", 1)[0]
                if not _config_key(key):
                    problems.append(f"{page}: --set {key} is not a configuration key")
            if re.fullmatch(r"(train|benchmarks|scripts)/[\w/]+\.(py|sh)", word) and not (ROOT / word).is_file():
                problems.append(f"{page}: {word} does not exist")
    assert not problems, problems
    assert len(bash_commands()) > 10  # the walk found the commands


def test_yaml_config_snippets_load_as_run_configs(tmp_path):
    checked = 0
    for page in PAGES:
        for number, block in enumerate(blocks(page, "yaml")):
            document = yaml.safe_load(block)
            if not isinstance(document, dict) or not set(document) & {"data", "model", "sampler", "train", "optim"}:
                continue
            path = tmp_path / f"{page.stem}_{number}.yaml"
            path.write_text(block, encoding="utf-8")
            load_config(path, [], environ={})
            checked += 1
    assert checked >= 1


def test_relative_links_point_at_files_that_exist():
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.exists() and _id(resolved) not in FORTHCOMING:
                missing.append(f"{_id(page)} -> {target}")
    assert not missing, missing


def test_the_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    pages = {_id(page) for page in PAGES if page.parent.name == "docs"} | FORTHCOMING
    unlisted = sorted(page for page in pages - {"docs/index.md"} if f"]({Path(page).name})" not in index)
    assert not unlisted, unlisted


def test_the_configuration_reference_is_the_schemas():
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    # A fresh process, as the user runs it: a test that adds names to a registry cannot leak into it.
    generated = subprocess.run([sys.executable, "-m", "pksampler.train.config.reference"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout
    assert committed == generated, "run: python -m pksampler.train.config.reference > docs/configuration.md"


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"README.md has {lines} lines; the manual belongs in docs/"
