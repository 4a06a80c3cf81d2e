"""Let Lightning import on hosts whose torchvision wheel cannot load against the CPU torch.

Lightning imports torchmetrics, which imports ``torchvision.transforms`` and
``torchvision.models`` whenever a torchvision distribution is installed (the
dev extra installs one for timm). The wheel that matches this CPU torch fails
in its package ``__init__`` (it registers compiled operators it cannot
provide, see tests/reference_models.py); its submodules are plain Python and
load fine. :func:`importable_torchvision` registers the ``torchvision``
package without running that ``__init__`` when the normal import fails; on
a machine where torchvision works it changes nothing. Test code only: users'
environments import torchvision normally.
"""

from __future__ import annotations

import importlib.util
import sys
import types


def importable_torchvision() -> None:
    """Import torchvision, or register its package bare so its pure-Python submodules import."""
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        return  # not installed: torchmetrics then skips it
    except Exception:  # noqa: BLE001 - the wheel's operator registration fails with RuntimeError
        pass
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("torchvision")
    module = types.ModuleType("torchvision")
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__file__ = spec.origin
    module.__version__ = "0+bare"
    sys.modules["torchvision"] = module
