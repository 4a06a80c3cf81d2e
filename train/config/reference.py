"""The configuration reference (``docs/configuration.md``), generated from the schema so it cannot drift.

Run ``python -m pksampler.train.config.reference > docs/configuration.md``;
``tests/test_readme.py`` checks that the committed file equals this output.

Everything comes from :mod:`.schema`: the sections and their docstrings, each
field's default, its ``resumable`` and ``local`` flags, the comments written
above or beside the field in the source, and the rule's own wording, read by
asking the rule about a value no rule accepts (the error names what it wants).
The keys of a free-form ``args`` block (``data.args``, ``sampler.args``) come
from the implementations the application registers for it
(:func:`.choices.register_arguments`): each one's keyword arguments, their
defaults and their lines in its docstring's ``Args:`` section.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from typing import Any

from pksampler.train.config import choices, schema
from pksampler.train.errors import ConfigError

__all__ = ["argument_docs", "argument_rows", "field_comments", "render", "rule_text"]

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


def argument_docs(doc: str) -> dict[str, str]:
    """Argument name -> its text in the ``Args:`` section of a (dedented) Google-style docstring.

    An entry is ``name: text`` at the section's indentation, continued by more
    deeply indented lines; ``a, b: text`` documents both. A blank line or a
    line indented less than the entries ends the section.
    """
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Args:"), None)
    found: dict[str, str] = {}
    if start is None:
        return found
    indent, names = None, []
    for line in lines[start + 1:]:
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        entry = re.match(r"([\w, ]+): (.*)", line.strip())
        if not line.strip() or depth < indent:
            break
        if depth == indent and entry:
            names = [name.strip() for name in entry.group(1).split(",")]
            found.update({name: entry.group(2) for name in names})
        elif depth > indent and names:
            found.update({name: f"{found[name]} {line.strip()}" for name in names})
        else:
            break
    return found


def _value(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, dict):
        value = dict(value)
    return "`null`" if value is None else f"`{value!r}`".replace("True", "true").replace("False", "false")


def argument_rows(kind: str) -> list[tuple[str, str, str]]:
    """``(key, default, notes)`` for every key of ``<kind>.args``, over the names registered for ``kind``.

    A key that several names take is one row naming them (``folder, list, shards: ...``); its default is shown
    when they agree.
    """
    keys: dict[str, dict[str, Any]] = {}
    for name, (target, set_by_builder) in choices.arguments(kind).items():
        docs = argument_docs(inspect.getdoc(target) or "")
        for parameter in inspect.signature(target).parameters.values():
            if parameter.name in set(set_by_builder) or parameter.kind in (parameter.VAR_POSITIONAL,
                                                                           parameter.VAR_KEYWORD):
                continue
            row = keys.setdefault(parameter.name, {"names": [], "defaults": set(), "text": ""})
            row["names"].append(name)
            row["defaults"].add("" if parameter.default is parameter.empty else _value(parameter.default))
            row["text"] = row["text"] or docs.get(parameter.name, "")
    return [(f"{kind}.args.{key}", row["defaults"].pop() if len(row["defaults"]) == 1 else "",
             f"{', '.join(row['names'])}: {row['text']}".rstrip(": ")) for key, row in keys.items()]


def _default(spec: dataclasses.Field) -> str:
    if spec.default is not dataclasses.MISSING:
        value = spec.default
    elif spec.default_factory is not dataclasses.MISSING:
        value = spec.default_factory()
    else:
        return ""
    if dataclasses.is_dataclass(value):
        return ""
    return _value(value)


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
        if spec.name == "args" and name:
            lines += [" | ".join(["", f"`{key}`", _cell(default), "", "", "", _cell(text), ""]).strip()
                      for key, default, text in argument_rows(name)]
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
