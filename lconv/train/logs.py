"""Run bookkeeping: the resolved config, a JSON-lines metrics log, TensorBoard events (tensorboardX, no
TensorFlow) and a progress bar with ETA."""
from __future__ import annotations

import json
import os
from typing import Any

import jax


def save_config(config: Any, workdir: str) -> None:
    """Writes ``config.json`` (the resolved config) unless the run already has one; a resume keeps the original."""
    path = os.path.join(workdir, "config.json")
    if jax.process_index() == 0 and not os.path.exists(path):
        with open(path, "w") as f:
            f.write(config.to_json_best_effort(indent=2, sort_keys=True))


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
