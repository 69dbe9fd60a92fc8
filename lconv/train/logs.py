"""Run bookkeeping: a JSON-lines metrics log, TensorBoard events (tensorboardX, no
TensorFlow) and a progress bar with ETA."""
from __future__ import annotations

import json
import os
from typing import Any

import jax


class MetricWriter:
    def __init__(self, workdir: str) -> None:
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")
        from tensorboardX import SummaryWriter

        self.tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, split: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        scalars = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        self.jsonl.write(json.dumps({"step": int(step), "split": split, **scalars}) + "\n")
        self.jsonl.flush()
        for key, value in scalars.items():
            self.tensorboard.add_scalar(f"{split}/{key}", value, step)
        if split != "train":
            print(f"step {step} {split}: " + " ".join(f"{k}={v:.4g}" for k, v in scalars.items()), flush=True)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tensorboard.close()


def progress(start: int, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(initial=start, total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=2.0,
                disable=jax.process_index() != 0)
