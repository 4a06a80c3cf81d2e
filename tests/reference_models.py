"""timm's own models, as the reference our ResNets and ViTs are compared with.

timm's ResNets use torchvision's tensor names and computation (its
``resnet50`` is torchvision's "v1.5"), and its ``VisionTransformer`` defines
the ViT names; so loading timm's state dicts into our modules, and getting
timm's outputs from them, checks both naming conventions with upstream code.

``import timm`` imports ``torchvision.ops.misc`` (for ``FrozenBatchNorm2d``).
The torchvision wheel that matches this CPU torch fails in its package
``__init__``, which registers compiled operators (``torchvision::nms``) that
the wheel cannot provide against this torch build. ``torchvision.ops.misc``
itself is plain Python, so when the normal import fails, :func:`import_timm`
registers the ``torchvision`` and ``torchvision.ops`` packages without
running their ``__init__`` and lets Python load the real submodules from the
installed wheel. On a machine where torchvision works, the normal import is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any


def _bare_package(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not installed (pip install -e '.[dev]')")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__file__ = spec.origin
    sys.modules[name] = module


def import_timm() -> Any:
    """The ``timm`` package, importable with or without a working torchvision."""
    if "timm" in sys.modules:
        return sys.modules["timm"]
    try:
        importlib.import_module("torchvision.ops.misc")
    except Exception:  # noqa: BLE001 - the wheel's operator registration fails here with RuntimeError
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        for package in ("torchvision", "torchvision.ops"):
            _bare_package(package)
        importlib.import_module("torchvision.ops.misc")
    return importlib.import_module("timm")
