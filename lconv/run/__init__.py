"""A run, as everything above training reads it: its config (the schema; read back from a workdir), its model,
mesh and shardings, its workdir and checkpoints, its trained params restored, and its loss over a split.

Training (``lconv.train``) builds on this layer, and so do the surfaces (the API, eval.py, export, the fairseq
importer, the bench and the study), which never import ``lconv.train`` for it (tests/test_layout.py).
"""
