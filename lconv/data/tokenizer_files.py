"""Where a run finds its tokenizer before training one: a copy an earlier run kept under data_dir, or the one lconv
ships beside the bundled snapshot (``lconv.data.pipeline.load_or_train_tokenizer`` looks in the workdir first, then
here)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from typing import Any

from lconv import json_text, shared_folders
from lconv.data import ddtp, paths, sources
from lconv.data import tokenizer as tokenizer_lib
from lconv.data.data_config import DataConfig

KEPT_TOKENIZERS = "tokenizers"  # under data_dir's lconv_prepared folder
KEPT_RECORD = "kept.json"  # beside a kept tokenizer: what it was kept for, and its bytes' SHA-256
logger = logging.getLogger(__name__)


def kept_dir(config: DataConfig) -> str:
    """Where a tokenizer for ``config.data``'s data and settings is kept under data_dir for later runs."""
    from lconv.data import tfds_ddtp  # imports tensorflow_datasets: seconds, so only when asked

    cfg = DataConfig.from_config(config)
    data = sources.config_data_path(cfg)
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", sources.display_name(cfg))  # ddtp/en_de -> ddtp_en_de; your name
    name = (f"{label}-{hashlib.sha256(data.encode()).hexdigest()[:12]}-v{cfg.vocab_size}"
            f"-n{cfg.tokenizer_max_sentences}-t{tokenizer_lib.TRAINING_VERSION}")
    return paths.join(paths.expand(cfg.data_dir), tfds_ddtp.CACHE_DIRNAME, KEPT_TOKENIZERS, name)


def kept_folder(config: DataConfig) -> str | None:
    """``kept_dir``'s folder, or None (one warning) where it is not a cache lconv can use: a link or a file at
    ``lconv_prepared``, ``tokenizers`` or the tokenizer's folder. A link planted in a shared data_dir had a run
    write its tokenizer where it led (replacing another run's) and read one from outside data_dir."""
    kept = kept_dir(config)
    problem = kept_folder_problem(kept)
    if problem:
        logger.warning(f"tokenizer: no copy kept under data_dir is read or written: {problem}; lconv keeps one only "
                       "in real folders below data_dir (training one for this run)")
        return None
    return kept


def kept_folder_problem(kept: str, *, make: bool = False) -> str | None:
    """Why ``kept`` (``kept_dir``'s) is not a real folder below data_dir at each of its three levels, or None; a
    level not made yet is fine (``make``: made here, one level at a time, never through a link). URLs have none."""
    if paths.is_url(kept):
        return None
    levels = (os.path.dirname(os.path.dirname(kept)), os.path.dirname(kept), kept)
    if make:
        os.makedirs(os.path.dirname(levels[0]), exist_ok=True)  # data_dir: the folder the user named
    for folder in levels:
        if make and not os.path.lexists(folder):
            with contextlib.suppress(FileExistsError):  # another run made it meanwhile: checked below
                os.mkdir(folder)  # its parent was checked just before: a real folder
        if os.path.islink(folder):
            return f"{folder} is a link (to {os.path.realpath(folder)})"
        if os.path.lexists(folder) and not os.path.isdir(folder):
            return f"{folder} is not a folder"
    shared = shared_folders.problem(kept)  # another user's planted tokenizer and record would pass as kept
    return shared[0] if shared else None


def shipped_name(dataset: str, source_key: str, vocab_size: int, max_sentences: int) -> str:
    """The file name of the tokenizer trained on a bundled corpus with these settings."""
    return (f"tokenizer-{dataset.replace('/', '_')}-{source_key}-v{vocab_size}-n{max_sentences}"
            f"-t{tokenizer_lib.TRAINING_VERSION}.model")


def shipped_path(config: DataConfig) -> str | None:
    """The tokenizer lconv ships for ``config``'s data and settings (``scripts/ship_tokenizer.py``), or None."""
    path = shipped_location(config)
    return path if path is not None and os.path.exists(path) else None


def shipped_location(config: DataConfig) -> str | None:
    """Where lconv/data/snapshot/ holds (or would hold) the tokenizer for ``config``; None for other data."""
    from lconv.data import tfds_ddtp

    cfg = DataConfig.from_config(config)
    key = tfds_ddtp.bundled_source_key(cfg.dataset) if cfg.raw_dir is None else None
    if key is None:
        return None
    return os.path.join(ddtp.SNAPSHOT_DIR, shipped_name(cfg.dataset, key, cfg.vocab_size, cfg.tokenizer_max_sentences))


def keep(tokenizer: Any, kept: str) -> None:
    """Keeps ``tokenizer`` in ``kept`` (``kept_dir``) for later runs, with the record ``usable_kept`` checks."""
    from lconv import outputs
    from lconv.errors import UserError

    problem = kept_folder_problem(kept, make=True)  # again: a link planted since kept_folder is not written through
    if problem:
        raise UserError(problem)
    tokenizer.save(kept)
    record = {"for": paths.basename(kept), "sha256": hashlib.sha256(tokenizer.to_bytes()).hexdigest(),
              "vocab_size": tokenizer.vocab_size}
    outputs.write_atomically(paths.join(kept, KEPT_RECORD), json.dumps(record, sort_keys=True))


def usable_kept(kept: str, vocab_size: int) -> Any:
    """The tokenizer kept in ``kept`` for this data and settings, else None with one warning."""
    from etils import epath

    from lconv.errors import UserError

    why = None
    try:
        tokenizer = tokenizer_lib.load_tokenizer(kept)
        record = json_text.loads(paths.read_bytes(epath.Path(paths.join(kept, KEPT_RECORD)), "no record of what it "
                                             "was kept for", within=kept, limit=1 << 20))
        if not isinstance(record, dict):
            why = "its record is not a JSON object"
        elif record.get("for") != paths.basename(kept):
            why = f"it was kept for {record.get('for')!r}, other data or settings"
        elif record.get("sha256") != hashlib.sha256(tokenizer.to_bytes()).hexdigest():
            why = "it is not the file that was kept (its SHA-256 differs from its record's)"
        elif getattr(tokenizer, "requested_vocab_size", tokenizer.vocab_size) != vocab_size:  # not its pieces:
            why = f"it was trained for another data.vocab_size than {vocab_size}"  # a small text gives fewer
    except (UserError, ValueError) as err:
        why = str(err).splitlines()[0][:300]
    if why is None:
        return tokenizer
    logger.warning(f"tokenizer: the copy kept in {kept} is not used ({why}); training one and keeping it instead")
    return None
