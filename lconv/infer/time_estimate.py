"""How long decoding a split will take, measured before it runs (the training budget's final evaluation): a batch's
fixed time plus its search steps, timed at the plan's narrowest and widest widths and taken linear in between. The
measurements behind this design: docs/default-run.md."""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from lconv.data import pipeline
from lconv.decode_settings import DecodeSettings
from lconv.infer import batching, compiled, shards
from lconv.infer.infer_config import InferConfig

# Each probe is the fastest of this many calls: a first call is slower, and load only adds time.
PROBE_REPEATS = 2
MIN_STEPS_APART = 8  # the two probes of a width separate its fixed time from a step's when their bounds differ so


def estimate_decode_seconds(config: InferConfig, eval_set: pipeline.EvalSet, translator: compiled.Translator,
                            settings: DecodeSettings, clock: Callable[[], float] = time.monotonic) -> float:
    """Seconds ``batching.decode_batches`` will take over ``eval_set`` with ``translator`` and ``settings``."""
    eval_set = shards.whole_split(eval_set, config.eval_batch_size)  # what score_split decodes (a collective)
    if not eval_set.tokens:
        return 0.0
    rows, order = batching.plan(config, translator.params, eval_set, settings.beam_size)
    batches, widths = batching.batches_of(eval_set, order, rows)
    steps = [step_bound(config, settings, eval_set, chosen, width) for chosen, width in zip(batches, widths)]
    narrow, wide = widths[0], max(widths)
    short, long = 0, max(i for i, width in enumerate(widths) if width == narrow)  # the narrowest width's batches
    fixed, per_step = {}, {}
    for compiling in [translator.prepare(rows, width, settings) for width in dict.fromkeys((narrow, wide))]:
        compiling.result()  # the probes' programs, compiled without running them
    for width in dict.fromkeys((narrow, wide)):
        sources = {i: batching.padded_batch(eval_set, batches[i], rows)[0]["inputs"][:, :width] for i in (short, long)}
        times = {i: min(_seconds_of_call(translator, sources[i], settings, clock) for _ in range(PROBE_REPEATS))
                 for i in dict.fromkeys(sources)}
        if steps[long] - steps[short] >= MIN_STEPS_APART:
            per_step[width] = max((times[long] - times[short]) / (steps[long] - steps[short]), 0.0)
            fixed[width] = max(times[short] - per_step[width] * steps[short], 0.0)
        else:  # one step count: the fixed time counted as steps (more than it is)
            fixed[width], per_step[width] = 0.0, times[short] / steps[short]
    for width in dict.fromkeys(widths):  # after the timing, which a compile beside it would slow
        translator.prepare(rows, width, settings)

    def linear(values: dict[int, float], width: int) -> float:
        return values[narrow] + (values[wide] - values[narrow]) * (width - narrow) / max(wide - narrow, 1)

    return sum(linear(fixed, width) + linear(per_step, width) * count for width, count in zip(widths, steps))


def _seconds_of_call(translator: compiled.Translator, inputs_BS: np.ndarray, settings: DecodeSettings,
                     clock: Callable[[], float]) -> float:
    start = clock()
    translator(inputs_BS, settings)
    return clock() - start


def step_bound(config: InferConfig, settings: DecodeSettings, eval_set: pipeline.EvalSet, chosen: list[int],
               width: int) -> int:
    """The most search steps decoding ``chosen`` at ``width`` takes: the longest row's length limit."""
    output_len = compiled.max_output_len(config, settings, width)
    if settings.max_len_a is None and settings.max_len_b is None:
        return output_len
    longest = max(min(len(eval_set.tokens[i]["inputs"]), width) for i in chosen)
    limit = math.floor((settings.max_len_a or 0.0) * longest + (settings.max_len_b or 0)) + 1
    return min(max(limit, 1), output_len)
