"""Run bookkeeping: a JSON-lines metrics log, TensorBoard events (tensorboardX, no
TensorFlow) and a progress bar with ETA."""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import uuid
from typing import Any

import jax
from etils import epath

from lconv import console, json_text, outputs
from lconv.data import paths
from lconv.errors import UserError
from lconv.run import workdir as workdir_lib

logger = logging.getLogger(__name__)


class _Discard:
    """Where a bar goes when its lines are printed plainly instead (it still counts, for its readers)."""

    def write(self, text: str) -> None:
        del text

    def flush(self) -> None:
        pass


class _RemoteLines:
    """An append-only text file on an object store: the whole file is rewritten on each flush."""

    def __init__(self, path: epath.Path) -> None:
        self.path = path
        self.text = path.read_text() if path.exists() else ""

    def write(self, line: str) -> None:
        self.text += line

    def flush(self) -> None:
        self.path.write_text(self.text)

    def close(self) -> None:
        self.flush()


# A row is about 200 bytes: a million steps' rows are well under this. A workdir's metrics.jsonl is read whole on
# resume, so one planted as a huge sparse file was a MemoryError traceback (or took the host without a limit).
METRICS_READ_LIMIT = 1 << 30


def read_metrics(path: epath.Path) -> str:
    """The text of a workdir's ``metrics.jsonl``: a regular file of at most ``METRICS_READ_LIMIT`` bytes, else one
    line naming it."""
    paths.check_file(path, limit=METRICS_READ_LIMIT)
    return path.read_text()


class MetricWriter:
    """``metrics.jsonl`` and TensorBoard scalars, written by process 0; local or remote workdirs."""

    def __init__(self, workdir: str, resumed_step: int = 0) -> None:
        self.enabled = jax.process_index() == 0
        if not self.enabled:
            return
        path = epath.Path(workdir) / "metrics.jsonl"
        outputs.refuse_link(path)  # before it is read or rewritten: its rows would land in the link's target
        _drop_rows_after(path, resumed_step)
        self.path, self.remote = path, workdir_lib.is_remote(workdir)
        # A rerun may log the resumed step's row again: the new row replaces the old.
        self.logged_at_resume = _rows_at(path, resumed_step)
        self.jsonl = _RemoteLines(path) if self.remote else outputs.open_append(path)
        from tensorboardX import SummaryWriter  # writes gs:// and s3:// itself

        _quiet_event_thread()
        events = f"{workdir}/tensorboard"
        # TensorBoard names its file by the second and the host name alone: a name anyone could plant a link or a
        # pipe at in the folder beforehand. A random suffix makes this launch's file a name nobody could foresee.
        suffix = f".{os.getpid()}.{uuid.uuid4().hex}"
        self._events_fd = None
        try:
            self.tensorboard = SummaryWriter(self._pinned(events), filename_suffix=suffix)
        except OSError as err:  # a file or an unwritable folder in its place was tensorboardX's traceback
            raise UserError(f"cannot write TensorBoard's events in {events}: {err.strerror or err}; it must be a "
                            "folder this process can write (move what is there away)") from None

    def _pinned(self, events: str) -> str:
        """``events`` as a name of the folder itself, where the system gives one (Linux's ``/proc/self/fd``): the
        folder is opened without following a link, so one swapped in for it after the workdir's checks is not where
        the events go."""
        if self.remote:
            return events
        os.makedirs(events, exist_ok=True)
        try:
            fd = os.open(events, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            outputs.refuse_link(events)  # a link: one line; anything else is the caller's OSError
            raise
        pinned = f"/proc/self/fd/{fd}"
        if not os.path.isdir(pinned):
            os.close(fd)
            return events
        self._events_fd = fd
        return pinned

    def write(self, step: int, split: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        scalars = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        if (int(step), split) in self.logged_at_resume:
            self.logged_at_resume.discard((int(step), split))
            self._drop_row(int(step), split)
        self.jsonl.write(json.dumps({"step": int(step), "split": split, **scalars}) + "\n")
        self.jsonl.flush()
        for key, value in scalars.items():
            self.tensorboard.add_scalar(f"{split}/{key}", value, step)
        if split != "train":
            print(f"step {step} {split}: " + " ".join(f"{k}={v:.4g}" for k, v in scalars.items()), flush=True)

    def _drop_row(self, step: int, split: str) -> None:
        """Removes the row of ``(step, split)`` written before this launch (rare: a rerun of a final evaluation)."""
        self.jsonl.close()
        lines = read_metrics(self.path).splitlines(keepends=True)
        outputs.write_atomically(self.path, "".join(line for line in lines if _row_key(line) != (step, split)))
        self.jsonl = _RemoteLines(self.path) if self.remote else outputs.open_append(self.path)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            try:
                self.tensorboard.close()
            except (OSError, ValueError) as err:  # its file failed already (a full disk): said once, by the thread
                logger.debug(f"TensorBoard writer closed with {type(err).__name__}: {err}")
            if self._events_fd is not None:
                os.close(self._events_fd)
                self._events_fd = None


def _quiet_event_thread() -> None:
    """A failed tensorboardX write in its own thread (a full disk) becomes a warning, not a traceback."""
    previous = threading.excepthook
    if getattr(previous, "lconv_quiet_events", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ != "_EventLoggerThread":
            previous(args)
            return
        logger.warning(f"TensorBoard events are no longer written ({args.exc_type.__name__}: {args.exc_value}); "
                       "metrics.jsonl has every value")

    hook.lconv_quiet_events = True
    threading.excepthook = hook


def _drop_rows_after(path: epath.Path, step: int) -> None:
    """Removes the rows of steps after ``step`` (the checkpoint a run resumes from)."""
    if not path.exists():
        return
    lines = read_metrics(path).splitlines(keepends=True)
    kept = [line for line in lines if _row_step(line) <= step]
    if len(kept) != len(lines):
        outputs.write_atomically(path, "".join(kept))


def _rows_at(path: epath.Path, step: int) -> set[tuple[int, str]]:
    """``{(step, split)}`` of the rows logged at ``step``."""
    if not path.exists():
        return set()
    return {key for key in map(_row_key, read_metrics(path).splitlines()) if key is not None and key[0] == step}


def _row_key(line: str) -> tuple[int, str] | None:
    try:
        row = json_text.loads(line)
        return int(row["step"]), str(row["split"])
    except (ValueError, OverflowError, KeyError, TypeError):
        return None


def _row_step(line: str) -> float:
    try:
        return float(json_text.loads(line)["step"])
    except (ValueError, OverflowError, KeyError, TypeError):
        return float("inf")  # a line cut by the kill: dropped too


BUDGET_BAR = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} s of the budget{postfix}"


class Progress:
    """The training bar: steps to ``train.num_steps`` or, with a time budget, its seconds."""

    def __init__(self, step: int, num_steps: int, budget: Any) -> None:
        from tqdm import tqdm

        self.budget, self.num_steps, self.step, self.shown = budget, num_steps, step, {}
        timed = budget is not None and budget.enabled
        # Redirected to a file, a bar is carriage returns and cursor moves: a plain line per log window instead.
        self.plain = jax.process_index() == 0 and not console.is_terminal(sys.stderr)
        self.bar = tqdm(initial=min(round(budget.elapsed()), round(budget.seconds)) if timed else step,
                        total=round(budget.seconds) if timed else num_steps, desc="train",
                        unit="s" if timed else "step", dynamic_ncols=True, mininterval=2.0,
                        disable=jax.process_index() != 0, file=_Discard() if self.plain else None,
                        **({"bar_format": BUDGET_BAR} if timed else {}))

    @property
    def total(self) -> float:
        return self.bar.total

    def advance(self, step: int) -> None:
        """After ``step``: a step more, or the seconds elapsed (and the step, in the postfix)."""
        self.step = step
        if self.budget is None or not self.budget.enabled:
            self.bar.update(1)
            return
        self.bar.set_postfix(self._postfix(), refresh=False)  # the step as it is at the bar's next refresh
        self.bar.update(max(min(round(self.budget.elapsed()), self.bar.total) - self.bar.n, 0))

    def set_postfix(self, **values: str) -> None:
        """The last log window's values, shown until the next (with a budget, beside the current step)."""
        self.shown = values
        self.bar.set_postfix(self._postfix())
        if self.plain:
            timed = self.budget is not None and self.budget.enabled
            budget = f" ({self.budget.elapsed():.0f}/{self.budget.seconds:.0f} s of the budget)" if timed else ""
            logger.info(f"step {self.step}/{self.num_steps} train{budget}: "
                        + " ".join(f"{k}={v}" for k, v in values.items()))

    def _postfix(self) -> dict[str, str]:
        timed = self.budget is not None and self.budget.enabled
        return {"step": f"{self.step}/{self.num_steps}", **self.shown} if timed else self.shown

    def close(self) -> None:
        self.bar.close()
