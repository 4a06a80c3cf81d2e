"""The configuration reference (``docs/configuration.md``), generated from the schema so it cannot drift.

Run ``python -m pksampler.train.config.reference > docs/configuration.md``;
``tests/test_readme.py`` checks that the committed file equals this output.

Everything comes from :mod:`.schema`: the sections and their docstrings, each
field's default, its ``resumable`` and ``local`` flags, the comments written
above or beside the field in the source, and the rule's own wording, read by
asking the rule about a value no rule accepts (the error names what it wants).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from typing import Any

from pksampler.train.config import schema
from pksampler.train.errors import ConfigError

__all__ = ["field_comments", "render", "rule_text"]

_UNACCEPTABLE = object()  # no rule accepts it: the error message says what the rule wants


def rule_text(rule: Any) -> str:
    """What ``rule`` accepts, in its own words (``an integer >= 1``, ``one of ['adamw', 'sgd']``), or ``""``."""
    if rule is None:
        return ""
    try:
        rule("key", _UNACCEPTABLE)
    except ConfigError as error:
        message = str(error).removeprefix("key: ")
        return re.sub(r", got <object object at 0x[0-9a-f]+>$", "", message).removeprefix("must be ")
    except (TypeError, ValueError, LookupError):
        return ""
    return ""


def field_comments(section: type) -> dict[str, str]:
    """Field name -> the comment lines written above it and beside it in the schema's source."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(section).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = re.match(r"(\w+): [^=]+=.*?(?:#\s*(.*))?$", stripped)
        if match:
            words = pending + ([match.group(2)] if match.group(2) else [])
            comments[match.group(1)] = " ".join(words)
        pending = []
    return comments


def _default(spec: dataclasses.Field) -> str:
    if spec.default is not dataclasses.MISSING:
        value = spec.default
    elif spec.default_factory is not dataclasses.MISSING:
        value = spec.default_factory()
    else:
        return ""
    if dataclasses.is_dataclass(value):
        return ""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, dict):
        value = dict(value)
    return "`null`" if value is None else f"`{value!r}`".replace("True", "true").replace("False", "false")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section(name: str, section: type) -> list[str]:
    doc = inspect.getdoc(section) or ""
    own_doc = doc if not doc.startswith(f"{section.__name__}(") else ""
    lines = [f"## `{name}`" if name else "## top level", ""]
    if own_doc:
        lines += [textwrap.dedent(own_doc), ""]
    lines += ["| key | default | rule | resume may change | ranks may differ | notes |",
              "| --- | --- | --- | --- | --- | --- |"]
    comments = field_comments(section)
    for spec in dataclasses.fields(section):
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            continue
        key = f"{name}.{spec.name}" if name else spec.name
        rule = rule_text(spec.metadata.get("rule"))
        lines.append(" | ".join(["", f"`{key}`", _cell(_default(spec)), _cell(rule),
                                 "yes" if spec.metadata.get("resumable") else "",
                                 "yes" if spec.metadata.get("local") else "",
                                 _cell(comments.get(spec.name, "")), ""]).strip())
    return lines + [""]


def render() -> str:
    """The whole reference as Markdown."""
    lines = ["# Configuration reference", "",
             "Generated from `train/config/schema.py` by `python -m pksampler.train.config.reference`; do not edit.",
             "A run's YAML file sets any of these keys; the platform's environment variables and `--set key=value`",
             "override it (file < environment < `--set`). Unknown keys are refused. *Resume may change*: a resumed run",
             "may set another value; every other key must equal the checkpoint's. *Ranks may differ*: per-host",
             "resources; every other key must be the same on every rank.", ""]
    lines += _section("", schema.RunConfig)
    for spec in dataclasses.fields(schema.RunConfig):
        value = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(value):
            lines += _section(spec.name, type(value))
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":  # the package pksampler.train, imported first, registers the choice lists
    print(render(), end="")
