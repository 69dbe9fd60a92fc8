"""A run, as everything above training reads it: its config, model, mesh and shardings, workdir and checkpoints,
restored params, and its loss over a split. The surfaces build on this, never on ``lconv.train``."""
