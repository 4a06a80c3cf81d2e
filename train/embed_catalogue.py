"""Embed a catalogue into .npy parts on every rank (one process, horovodrun or torchrun).

Usage::

    horovodrun -np 2 -H localhost:2 python train/embed_catalogue.py --checkpoint best.pt --data DIR --out catalogue

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
    from pksampler.train.catalogue.cli import embed_main

    sys.exit(embed_main())
