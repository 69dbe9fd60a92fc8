"""Which command owns which output: one rule for every lconv command that writes.

A command writes only into a directory that is new or empty, or that already holds its own kind of output, and
never over a file that another command produced, over an input it reads, or over an lconv checkout's committed
``docs/`` (those are written only by the commands' defaults, run from the checkout's root). Every refusal is one
``UserError`` line naming the flag and the path, raised before any work.

Each kind of output directory is recognised by its marker (``.lconv-output.json``, written by the command that
claims it) or, for one made before markers, by the file only that kind writes (``KIND_SIGNATURES``). Inside a
workdir, the entries that make it a run (``WORKDIR_CORE``: the config, tokenizer, checkpoints, ...) are written by
train.py and the fairseq importer alone; eval.py writes its outputs beside them.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable

from etils import epath

from lconv.errors import UserError

MARKER = ".lconv-output.json"
KIND_NAMES = {"workdir": "a training workdir", "export": "an exported model", "bench": "benchmark results",
              "study": "a study's runs"}
KIND_SIGNATURES = {"workdir": ("config.json",), "export": ("lconv_export.json",), "study": ("records.json",)}
# The entries of a workdir that only train.py / the importer write (eval.py's outputs go beside them).
WORKDIR_CORE = ("config.json", "spm.model", "pieces.json", "checkpoints", "best", "metrics.jsonl", "tensorboard",
                "train.lock", "compilation_cache", "checkpoint_errors.log", MARKER)


def _is_url(path: str) -> bool:
    return "://" in path


def _absolute(path: str) -> str:
    return path if _is_url(path) else os.path.realpath(os.path.expanduser(path))


def kind_of(directory: str) -> str | None:
    """The kind of output ``directory`` holds (its marker, else its signature file), or None."""
    root = epath.Path(directory)
    try:
        marker = root / MARKER
        if marker.exists():
            kind = json.loads(marker.read_text()).get("kind")
            if kind in KIND_NAMES:
                return kind
        for kind, files in KIND_SIGNATURES.items():
            if all((root / name).exists() for name in files):
                return kind
    except (OSError, ValueError, AttributeError):
        return None
    return None


def checkout_docs(path: str) -> str | None:
    """The ``docs/`` folder of the lconv checkout that ``path`` lies in, or None."""
    if _is_url(path):
        return None
    path = _absolute(path)
    parent = path
    while True:
        parent, child = os.path.dirname(parent), parent
        if parent == child:
            return None
        if _is_lconv_checkout(parent):
            docs = os.path.join(parent, "docs")
            return docs if path == docs or path.startswith(docs + os.sep) else None


def _is_lconv_checkout(directory: str) -> bool:
    try:
        with open(os.path.join(directory, "pyproject.toml"), encoding="utf-8") as f:
            return 'name = "lconv"' in f.read() and os.path.isdir(os.path.join(directory, "lconv"))
    except OSError:
        return False


def _refuse_committed_docs(path: str, flag: str, committed_ok: str | None) -> None:
    docs = checkout_docs(path)
    if docs and not (committed_ok and _absolute(committed_ok) == _absolute(path)):
        raise UserError(f"{flag}={path} is inside the lconv checkout's committed {docs}: only the command's own "
                        f"default, run from the checkout's root, writes there; choose another folder")


def claim_directory(path: str, kind: str, flag: str, *, committed_ok: str | None = None) -> str:
    """Checks that ``path`` may hold ``kind`` output (new, empty, or already of that kind), creates it and marks it
    as ``kind``'s; returns it. ``committed_ok``: the one path inside a checkout's docs/ this command may write
    (its default from the checkout's root)."""
    if not path or not str(path).strip():
        raise UserError(f"{flag} is empty: name a folder for {KIND_NAMES[kind]}")
    path = str(path)
    _refuse_committed_docs(path, flag, committed_ok)
    root = epath.Path(path if _is_url(path) else os.path.expanduser(path))
    try:
        if root.exists() and not root.is_dir():
            raise UserError(f"{flag}={path} is a file; {KIND_NAMES[kind]} is a folder")
        if root.exists() and any(True for _ in root.iterdir()):
            found = kind_of(str(root))
            if found is None:
                raise UserError(f"{flag}={path} is a folder with other files and no lconv output in it; "
                                f"{KIND_NAMES[kind]} goes into a new or empty folder")
            if found != kind:
                raise UserError(f"{flag}={path} holds {KIND_NAMES[found]}, not {KIND_NAMES[kind]}; "
                                f"choose another folder")
        root.mkdir(parents=True, exist_ok=True)
        if not (root / MARKER).exists():
            (root / MARKER).write_text(json.dumps({"kind": kind}) + "\n")
    except OSError as err:
        raise UserError(f"{flag}={path}: cannot write there ({err.strerror or err})") from None
    return path


def check_output_file(path: str, flag: str, *, inputs: Iterable[tuple[str, str | None]] = ()) -> None:
    """Refuses a file output that is one of ``inputs`` (``(flag, path)`` pairs), lies in an lconv checkout's
    committed docs/, or is part of another command's output: a workdir's core entries (``WORKDIR_CORE``) or
    anything in an export, a study or benchmark folder."""
    if not path or not str(path).strip():
        raise UserError(f"{flag} is empty: name a file")
    target = _absolute(str(path))
    for input_flag, input_path in inputs:
        if input_path and _absolute(str(input_path)) == target:
            raise UserError(f"{flag}={path} is the file {input_flag} reads; write the output elsewhere")
    _refuse_committed_docs(str(path), flag, None)
    parent = os.path.dirname(target) if not _is_url(target) else target.rsplit("/", 1)[0]
    for _ in range(64):  # each folder above the file, up to the root
        kind = kind_of(parent)
        if kind is not None:
            first = (target[len(parent):].lstrip("/" + os.sep).replace(os.sep, "/").split("/") or [""])[0]
            if kind != "workdir" or first in WORKDIR_CORE:
                raise UserError(f"{flag}={path} would overwrite part of {KIND_NAMES[kind]} ({parent}); write the "
                                f"output elsewhere")
        up = os.path.dirname(parent) if not _is_url(parent) else parent.rsplit("/", 1)[0]
        if up == parent or not up or up.endswith(":/"):
            return
        parent = up
