"""Trains the tokenizer a config gets on the bundled corpus and writes it beside the snapshot, to ship with lconv.

    PYTHONPATH=. python scripts/ship_tokenizer.py                  # configs/default.py's data settings
    PYTHONPATH=. python scripts/ship_tokenizer.py default --data_dir=runs/tfds
    PYTHONPATH=. python scripts/ship_tokenizer.py lm1b:ddtp        # the bundled LM's (ddtp/lm_en)

A run whose data settings name a shipped tokenizer copies it instead of training one
(``lconv.data.tokenizer_files.shipped_path``); tests/test_shipped_tokenizer.py trains them again and
compares the bytes of each. Run this after changing the default's vocabulary or sample size, the snapshot, or the
tokenizer's training (``tokenizer.TRAINING_VERSION``), and delete the file it replaces.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lconv.data import pipeline, tokenizer_files  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="default",
                        help="a config of lconv.configs, by name, with its variant after a colon (lm1b:ddtp)")
    parser.add_argument("--data_dir", help="where the corpus is prepared (default: the config's)")
    args = parser.parse_args()
    name, _, variant = args.config.partition(":")
    config = importlib.import_module(f"lconv.configs.{name}").get_config(variant or None)
    if args.data_dir:
        config.data.data_dir = args.data_dir
    path = tokenizer_files.shipped_location(config.data)
    if path is None:
        sys.exit(f"error: {config.data.dataset} (raw_dir={config.data.raw_dir!r}) is not prepared from the bundled "
                 "snapshot")
    with tempfile.TemporaryDirectory() as empty_workdir:  # what a run with nothing kept or shipped trains
        trained = pipeline.load_or_train_tokenizer(config.data, empty_workdir, save=False)
    with open(path, "wb") as f:
        f.write(trained.to_bytes())
    print(path)


if __name__ == "__main__":
    main()
