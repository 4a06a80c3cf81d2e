"""From a trained checkpoint to a searchable catalogue: export, embed, index, query.

The application layer's second room beside the trainer (nothing imports it):

* :mod:`.model` loads the embedding network of a ``best.pt``/``last.pt`` with
  its preprocessing and a digest that names it;
* :mod:`.export` writes it as ONNX (dynamic batch axis) and as a
  ``torch.export`` program (``.pt2``), the preprocessing in each file's metadata;
* :mod:`.parts` and :mod:`.embed` embed a catalogue across ranks into ``.npy``
  parts that faiss and autofaiss read as they are;
* :mod:`.versions` records each version's items (name, class, content
  fingerprint), so embedding the source again adds only what is new or
  changed and removes what left;
* :mod:`.index` builds a faiss index from the parts with a recall certificate;
  :mod:`.update` and :mod:`.delta` grow and shrink it in place;
* :mod:`.query` searches it and writes JSON lines and a gallery PNG.

The scripts beside ``train/retrieval.py`` run the steps: ``export_model.py``,
``embed_catalogue.py``, ``build_index.py``, ``query_catalogue.py``.
"""
