"""Search the catalogue with query images: top-k as JSON lines and a gallery PNG.

Usage::

    python train/query_catalogue.py IMAGES... --index index --checkpoint best.pt --out results

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
    from pksampler.train.catalogue.cli import query_main

    sys.exit(query_main())
