"""Export a checkpoint's embedding model for serving (ONNX and torch.export).

Usage::

    python train/export_model.py workspace/demo/checkpoints/best.pt --out workspace/demo/model

See docs/catalogue.md for the walk-through (train, export, embed, index, query).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Run as a script, Python puts train/ first on sys.path; drop it so module
# names in this folder cannot shadow installed packages.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

if __name__ == "__main__":
    from pksampler.train.catalogue.cli import export_main

    sys.exit(export_main())
