"""eval.py's ``--ensemble=DIR[,DIR...]``: more runs decoding together with ``--workdir``'s, as fairseq-generate's
``--path a.pt:b.pt`` (``lconv.run.ensembles``: each next-token distribution is the members' mean, so a score is
the log of their mean probability).

The members are checked before anything loads: each a run, of ``--workdir``'s task, with its tokenizer (one
vocabulary). Their outputs are named for an ensemble (``<split>.ensemble.hyp.txt`` and ``.scores.json``, naming
the members; ``output.ensemble.txt``) in ``--workdir``, so a run's own outputs are never overwritten.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from lconv.data import tokenizer as tokenizer_lib
from lconv.errors import UserError
from lconv.run import ensembles, restore

logger = logging.getLogger(__name__)

NAME = "ensemble"  # in every output's name: <split>.ensemble.hyp.txt, output.ensemble.txt


def parse(value: str | Sequence[str] | None) -> list[str]:
    """The flag's workdirs (comma-separated, or a list from Python); [] without the flag."""
    if value is None:
        return []
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [name.strip() for name in names]
    if not names or any(not name for name in names):
        raise UserError(f"--ensemble={value!r}: name the other runs' workdirs, comma-separated (--ensemble=DIR,DIR); "
                        "--workdir is the first member")
    return names


@dataclasses.dataclass(frozen=True)
class Members:
    """``--workdir`` then the ``--ensemble`` runs, with their stored configs (``restore.read_stored``)."""

    workdirs: list[str]
    stored: list[restore.StoredConfig]
    steps: list[list[int]] = dataclasses.field(default_factory=list)  # each member's checkpoints, once loaded

    def names(self) -> list[str]:
        return ["--workdir"] + [f"--ensemble[{i}]" for i in range(1, len(self.workdirs))]


def check(workdir: str, stored: restore.StoredConfig, others: Sequence[str]) -> Members:
    """The members, each checked against ``--workdir``'s run before anything loads: a run, the same task, the
    same tokenizer (a stream LM's split is scored with its mixers' state carried: one model's, not an ensemble's)."""
    members = Members([workdir], [stored])
    first_tokenizer = _tokenizer_bytes(workdir, "--workdir")
    for i, other in enumerate(others, start=1):
        name = f"--ensemble[{i}]"
        member = restore.read_stored(other, caller=name)
        if member.config.task != stored.config.task:
            raise UserError(f"{name}={other} is a {member.config.task} run, --workdir={workdir} a "
                            f"{stored.config.task} run: an ensemble's members share one task")
        if _tokenizer_bytes(other, name) != first_tokenizer:
            raise UserError(f"{name}={other} has another tokenizer than --workdir={workdir}: an ensemble's members "
                            "share one vocabulary")
        members.workdirs.append(other)
        members.stored.append(member)
    return members


def _tokenizer_bytes(workdir: str, name: str) -> bytes:
    try:
        return tokenizer_lib.load_tokenizer(workdir).to_bytes()
    except UserError as err:
        raise UserError(f"{name}={workdir}: {err}") from None


def load(members: Members, *, average_last: int, checkpoint: str) -> restore.Trained:
    """Every member restored alike (``average_last``, ``checkpoint``) and combined: the first's config with the
    members' shortest length limits (``ensembles.shared_limits``, said once)."""
    names = members.names()
    loaded = [restore.load_trained(w, average_last=average_last, checkpoint=checkpoint, stored=s, caller=name)
              for w, s, name in zip(members.workdirs, members.stored, names)]
    members.steps[:] = [list(t.steps) for t in loaded]
    trained = ensembles.combine(loaded, names)
    trained.config = trained.config.replace(optim={"fused_loss": False})  # an ensemble outputs log-probs, never an
    # output layer's inputs
    listed = ", ".join(f"{w} (checkpoint(s) {t.steps})" for w, t in zip(members.workdirs, loaded))
    logger.info(f"ensemble of {len(loaded)} runs, their next-token probabilities averaged: {listed}")
    return trained


def report(members: Members) -> dict[str, Any]:
    """What an ensemble's scores file adds: its members, in order, and the checkpoints each decoded with."""
    return {"ensemble": list(members.workdirs), "ensemble_checkpoints": [list(s) for s in members.steps]}
