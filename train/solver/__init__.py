"""The optimizer, its schedule and fine-tuning's parameter groups and backbone freeze.
"""

from __future__ import annotations
