"""The gpu command's budget: each stage's cap from ``--minutes``, and each stage's rows fitted to its cap.

Pure arithmetic, so a test can check with a fake clock that a plan fits its cap. The per-row estimates are seconds on a
datacenter GPU (docs/benchmarks-gpu.md); a stage keeps its rows in order of value while they fit, and marks the others
cut with the reason.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TypeVar

Item = TypeVar("Item")

DEFAULT_MINUTES = 8.0  # the command's default: with one stage's kill grace and the machine's start, under 9 minutes
# Each stage's share of --minutes (summing to 1); the run stage needs 3 minutes for a BLEU that means anything.
STAGES = (("ops", 0.17), ("train", 0.18), ("run", 0.45), ("beam", 0.20))
PROFILE_SHARE = 0.07  # --profile adds a stage of this share; the others shrink in proportion
RUN_MIN_BUDGET_S = 180.0  # the run stage's budget at the default minutes, --profile or not, is at least this
RUN_MARGIN_S = 10.0  # the run's budget stops this long before its stage's cap (process exit, the report)
STAGE_START_S = 8.0  # a stage process's start: Python, jax and the backend (measured on GPU hosts: 4-8 s)


def stage_caps(minutes: float, profile: bool = False) -> list[tuple[str, float]]:
    """``[(stage, cap seconds)]`` in running order: ``STAGES``' shares of ``minutes`` (and ``profile``'s)."""
    total = minutes * 60
    if not profile:
        return [(stage, share * total) for stage, share in STAGES]
    caps = []
    for stage, share in STAGES:
        caps.append((stage, share * (1 - PROFILE_SHARE) * total))
        if stage == "train":
            caps.append(("profile", PROFILE_SHARE * total))
    return caps


def run_budget(cap_s: float) -> float:
    """The default run's ``train.max_minutes`` (in seconds) inside a run stage of ``cap_s``."""
    return cap_s - STAGE_START_S - RUN_MARGIN_S


def stage_cap(planned_s: float, later_s: float, left_s: float) -> float:
    """A stage's cap less what earlier stages overran (``left_s`` left, ``later_s`` planned after), at least a tenth."""
    return max(min(planned_s, left_s - later_s), 0.1 * planned_s)


@dataclasses.dataclass
class Fitted:
    """A stage's plan: the items kept (in order) with their estimated seconds, and the items cut."""

    kept: list
    cut: list
    seconds: float


def fit(items: Sequence[Item], estimate: Callable[[Item], float], cap_s: float) -> Fitted:
    """Keeps ``items`` (by value) while their ``estimate``s fit ``cap_s``; a cut item does not stop later ones."""
    kept, cut, seconds = [], [], 0.0
    for item in items:
        cost = estimate(item)
        if seconds + cost <= cap_s:
            kept.append(item)
            seconds += cost
        else:
            cut.append(item)
    return Fitted(kept, cut, seconds)


# Seconds a GPU takes per op row: compiling its program (spread over the threads) and timing it
OP_COMPILE_S = {"band": 2.0, "pallas": 4.0, "pallas-fused": 4.0, "conv": 7.0, "shift": 2.0, "unfold": 3.0}
OP_MEASURE_S = 1.0
TRAIN_T_S = 30.0  # one T of the train stage: three models compiled at once (10-15 s each alone), timed in turn
TRAIN_MATMUL_S = 3.0  # the matmul rate measured before the first T
PROFILE_S = 15.0  # one model's step compiled (read back from the shared cache: the train stage compiled it) and traced
BEAM_LOAD_S = 10.0  # the trained checkpoint read and the test split tokenised
BEAM_ROWS_S = 19.0  # one decoding batch size: its programs compiled and a first pass (12-16 s), 3 timed passes


def op_row_seconds(impl: str, threads: int) -> float:
    """A GPU op row's estimated seconds (``impl``'s compile spread over ``threads``, and its timing)."""
    return OP_COMPILE_S.get(impl, max(OP_COMPILE_S.values())) / max(threads, 1) + OP_MEASURE_S


def train_fit(T_list: Sequence[int], seconds_left: float) -> Fitted:
    """The train stage's lengths that fit ``seconds_left`` after the matmul rate's measurement."""
    return fit(T_list, lambda T: TRAIN_T_S, seconds_left - TRAIN_MATMUL_S)


def beam_fit(rows_list: Sequence[int], seconds_left: float) -> Fitted:
    """The beam stage's batch sizes that fit ``seconds_left`` after the load and auto's size (always first)."""
    return fit(rows_list, lambda rows: BEAM_ROWS_S, seconds_left - BEAM_LOAD_S - BEAM_ROWS_S)


def cut_reason(seconds: float, cap_s: float) -> str:
    """A cut row's status: the stage's plan had no room for it in ``cap_s``, or nothing was left of the cap."""
    if cap_s <= 0:
        return "cut: not in the plan (no time left in the stage's cap: earlier stages overran theirs)"
    return f"cut: not in the plan (the kept rows take an estimated {seconds:.0f} s of the {cap_s:.0f} s cap)"


TIME_RAN_OUT = "cut: the stage's time ran out"
