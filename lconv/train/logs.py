"""Run bookkeeping: a JSON-lines metrics log, TensorBoard events (tensorboardX, no
TensorFlow) and a progress bar with ETA."""
from __future__ import annotations

import json
from typing import Any

import jax
from etils import epath

from lconv.train import workdir as workdir_lib


class _RemoteLines:
    """An append-only text file on an object store (gs://...), which cannot append: the lines are kept and the
    whole file is rewritten on each flush (metrics are small: a row per log step)."""

    def __init__(self, path: epath.Path) -> None:
        self.path = path
        self.text = path.read_text() if path.exists() else ""

    def write(self, line: str) -> None:
        self.text += line

    def flush(self) -> None:
        self.path.write_text(self.text)

    def close(self) -> None:
        self.flush()


class MetricWriter:
    """``metrics.jsonl`` and TensorBoard scalars, written by process 0; local or remote workdirs."""

    def __init__(self, workdir: str) -> None:
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        path = epath.Path(workdir) / "metrics.jsonl"
        self.jsonl = _RemoteLines(path) if workdir_lib.is_remote(workdir) else open(path, "a")
        from tensorboardX import SummaryWriter  # writes gs:// and s3:// itself

        self.tensorboard = SummaryWriter(f"{workdir}/tensorboard")

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
