"""Restored runs decoding together (``lconv.nn.ensemble``): combined into one ``restore.Trained``, for the API's
``lconv.ensemble`` and eval.py's ``--ensemble``."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lconv.errors import UserError
from lconv.nn import ensemble as model_ensemble
from lconv.run import restore
from lconv.run.schema import RunConfig

logger = logging.getLogger(__name__)

LIMITS = ("data.eval_max_input_length", "data.eval_max_target_length", "model.max_len")


def combine(members: Sequence[restore.Trained], names: Sequence[str]) -> restore.Trained:
    """``members`` (``names``: how the caller calls each) as one ensemble with the first's config and tokenizer,
    which every member must share. A member that is an ensemble adds its members, so every model weighs the
    same; each gets its own module instance, so no two share a decoding cache."""
    first = members[0]
    singles: list[tuple[Any, Any, str]] = []  # (module, params, name) of every single model
    for trained, name in zip(members, names):
        if trained.tokenizer.to_bytes() != first.tokenizer.to_bytes():
            raise UserError(f"{name} ({trained.workdir}) has another tokenizer than {names[0]} ({first.workdir}): "
                            "an ensemble's members share one vocabulary")
        if isinstance(trained.model, model_ensemble.Ensemble):
            singles += [(m, trained.params[f"members_{j}"], name) for j, m in enumerate(trained.model.members)]
        else:
            singles.append((trained.model, trained.params, name))
    model_ensemble.check_members([m for m, _, _ in singles], [name for _, _, name in singles])
    datasets = {name: trained.config.data.dataset for trained, name in zip(members, names)}
    if len(set(datasets.values())) > 1:  # legitimate (two corpora, one direction), or a swapped direction
        logger.warning("ensemble: its members were trained on different datasets ("
                       f"{', '.join(f'{name}: {dataset}' for name, dataset in datasets.items())}); their "
                       "distributions are averaged as they are: check they translate in one direction")
    module = model_ensemble.Ensemble(tuple(m.clone(parent=None) for m, _, _ in singles))
    params = {f"members_{j}": member_params for j, (_, member_params, _) in enumerate(singles)}
    return restore.Trained(shared_limits(members, names), ":".join(t.workdir for t in members), first.tokenizer,
                           module, params, [step for t in members for step in t.steps])


def shared_limits(members: Sequence[restore.Trained], names: Sequence[str]) -> RunConfig:
    """The first member's config with each length limit (``LIMITS``, in tokens) the members' minimum, so that no
    member is handed a source, target or prompt longer than its positions; a limit lowered below what the first
    member alone allows (its positions: an LM's unused input limit is no news) is said once."""
    config, lowered, changes = members[0].config, [], {}
    for name in LIMITS:
        section, field = name.split(".")
        values = [min(int(getattr(getattr(t.config, section), field)), int(t.config.model.max_len))
                  for t in members]
        ours, lowest = int(getattr(getattr(config, section), field)), min(values)
        if lowest < values[0]:
            at = values.index(lowest)
            # The member's own field that sets the value: its positions (model.max_len) cap each of its limits.
            own = int(getattr(getattr(members[at].config, section), field))
            lowered.append(f"config.{name} {ours} -> {lowest} ({names[at]}'s "
                           f"config.{name if own == lowest else 'model.max_len'})")
        if lowest < ours:
            changes.setdefault(section, {})[field] = lowest
    if lowered:
        logger.warning(f"ensemble: its length limits are its members' minimum: {', '.join(lowered)}")
    return config.replace(**changes) if changes else config
