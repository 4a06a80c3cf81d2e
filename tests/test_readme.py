"""The README's quick start runs as written."""

from __future__ import annotations

import re

from launch import ROOT


def test_quick_start_snippet_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    quick_start = next(block for block in blocks if "DistributedBalancedSampler(" in block)
    exec(compile(quick_start, "README.md quick start", "exec"), {"__name__": "readme"})
