"""timm's own models, as the reference our ResNets and ViTs are compared with.

timm's ResNets use torchvision's tensor names and computation (its
``resnet50`` is torchvision's "v1.5"), and its ``VisionTransformer`` defines
the ViT names; so loading timm's state dicts into our modules, and getting
timm's outputs from them, checks both naming conventions with upstream code.

Where the code comes from: ``import timm`` imports torchvision's Python
modules (``torchvision.ops.misc`` for ``FrozenBatchNorm2d``, its
transforms). The torchvision wheel built for this torch fails in its package
``__init__``, which registers compiled operators (``torchvision::nms``) that
it cannot provide against the CPU torch, and installed in the environment it
would break ``import lightning``. So scripts/setup.sh installs neither in the
environment: it puts the released files of both in ``<venv>/reference/``
(:data:`REFERENCE`), and :func:`import_timm` registers the ``torchvision`` and
``torchvision.ops`` packages from there without running their ``__init__``
(their submodules are the real, unmodified files) and imports timm from its
folder. Where torchvision works (the GPU machine), the normal imports are used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

#: where scripts/setup.sh installs the reference code: one folder per package, outside site-packages
REFERENCE = Path(sys.prefix) / "reference"


def _bare_package(name: str, locations: list[str]) -> None:
    """``name`` as a package whose submodules load from ``locations``, without its ``__init__``."""
    module = types.ModuleType(name)
    module.__path__ = locations
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    module.__spec__.submodule_search_locations = locations
    module.__file__ = str(Path(locations[0]) / "__init__.py")
    sys.modules[name] = module


def _reference_torchvision() -> None:
    """Register torchvision's packages bare: from the environment if it has them, else from :data:`REFERENCE`."""
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("torchvision")
    root = Path(spec.submodule_search_locations[0]) if spec is not None else REFERENCE / "torchvision" / "torchvision"
    if not (root / "ops" / "misc.py").is_file():
        raise ImportError(f"torchvision's code is in neither the environment nor {root.parent}: run ./scripts/setup.sh")
    _bare_package("torchvision", [str(root)])
    _bare_package("torchvision.ops", [str(root / "ops")])


def import_timm() -> Any:
    """The ``timm`` package, its torchvision imports served by torchvision's own Python files."""
    if "timm" in sys.modules:
        return sys.modules["timm"]
    try:
        importlib.import_module("torchvision.ops.misc")  # a working torchvision
    except Exception:  # noqa: BLE001 - absent (ImportError) or the wheel's operator registration (RuntimeError)
        _reference_torchvision()
        importlib.import_module("torchvision.ops.misc")
    if importlib.util.find_spec("timm") is None:
        if not (REFERENCE / "timm" / "timm" / "__init__.py").is_file():
            raise ImportError(f"timm's code is in neither the environment nor {REFERENCE / 'timm'}: run "
                              "./scripts/setup.sh")
        sys.path.append(str(REFERENCE / "timm"))
    return importlib.import_module("timm")
