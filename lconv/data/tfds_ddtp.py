"""tfds builders written as array_record, prepared and read with no TensorFlow installed.

- ``ddtp``: one BuilderConfig per task (``en_de``, ``en_fr``, ``en_es``, ``en_zh``, ``summarize_en``,
  ``lm_en``), from the bundled snapshot (default) or from raw apt Translation files (``raw_dir=``).
- ``iwslt14``: config ``de_en``, local parallel text files ``{train,valid,test}.{de,en}`` (one sentence per line,
  e.g. fairseq's ``prepare-iwslt14.sh`` output before BPE) in ``raw_dir``.

TensorFlow-free, as verified with tensorflow-datasets 4.9.10 and no TensorFlow: a ``GeneratorBasedBuilder``
whose features are only ``tfds.features.Text`` prepares with ``file_format="array_record"`` through tfds's
NumPy/pure-Python writer (no Beam), and ``tfds.data_source`` reads it back (Text features come back as bytes).
Two traps, both handled here: ``dataset_info_from_configs`` wants a package directory with metadata files, so
``_info`` builds ``tfds.core.DatasetInfo`` directly; and ``code_path`` needs ``importlib_resources`` (see
``_LocalBuilder``). Preparing ``ddtp/en_de`` from the snapshot takes a few seconds.

    builder = prepare("ddtp/en_de", data_dir)           # idempotent; reuses a prepared copy
    source = tfds.data_source("ddtp/en_de", split="train", data_dir=data_dir)   # after importing this module
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import tensorflow_datasets as tfds
from etils import epath

from lconv.data import ddtp
from lconv.errors import UserError

_TASK_FIELDS = {
    **{task: ("en", task.split("_")[1]) for task in ddtp.TRANSLATION_TASKS},
    "summarize_en": ("document", "summary"),
    "lm_en": ("text",),
}
_CITATION = """@misc{ddtp, title={Debian Description Translation Project}, note={Debian 12 bookworm main, apt
Translation files}}"""


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of the builders here: fixes ``code_path`` for TensorFlow-free use on Python >= 3.9.

    tfds 4.9.10 computes ``code_path`` through ``importlib_resources`` (a backport it only declares for
    Python < 3.9), so ``download_and_prepare`` of any builder defined in a package fails with
    ModuleNotFoundError. The path is only used to look for a checksums file next to the code; this file is it.
    """

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)


class DdtpConfig(tfds.core.BuilderConfig):
    """A DDTP task: its text fields (plus ``md5``, the description the example comes from)."""

    def __init__(self, *, name: str, **kwargs):
        super().__init__(name=name, version=tfds.core.Version("1.0.0"), **kwargs)
        self.fields = _TASK_FIELDS[name]


class Ddtp(_LocalBuilder):
    """DDTP: Debian package descriptions and their human translations (see lconv/data/snapshot/README.md)."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Debian 12 bookworm main; md5-hash split; de-duplicated, no text across splits."}
    BUILDER_CONFIGS = [DdtpConfig(name=task, description=f"DDTP task {task}") for task in ddtp.TASKS]

    def __init__(self, *, raw_dir: str | None = None, **kwargs):
        self._raw_dir = raw_dir  # None: the bundled snapshot
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        features = {field: tfds.features.Text() for field in (*self.builder_config.fields, "md5")}
        return tfds.core.DatasetInfo(
            builder=self, description=self.__doc__, features=tfds.features.FeaturesDict(features),
            supervised_keys=tuple(self.builder_config.fields) if len(self.builder_config.fields) == 2 else None,
            homepage="https://www.debian.org/international/l10n/ddtp", citation=_CITATION)

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        tasks = ddtp.load_tasks(self._raw_dir, tasks=[self.builder_config.name])
        return {split: self._generate_examples(examples)  # tfds cannot write an empty split (tiny corpora)
                for split, examples in tasks[self.builder_config.name].items() if examples}

    def _generate_examples(self, examples) -> Iterator[tuple[str, dict]]:
        for i, example in enumerate(examples):
            yield f"{example['md5']}-{i}", example


class Iwslt14(_LocalBuilder):
    """IWSLT14 De-En from local files ``{train,valid,test}.{de,en}`` in ``raw_dir`` (no download)."""

    VERSION = tfds.core.Version("1.0.0")
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="de_en", description="IWSLT14 German-English, local files")]

    def __init__(self, *, raw_dir: str | None = None, **kwargs):
        self._raw_dir = raw_dir
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict({"de": tfds.features.Text(), "en": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, description=self.__doc__, features=features,
                                     supervised_keys=("de", "en"))

    def _split_generators(self, dl_manager):
        del dl_manager
        if self._raw_dir is None:
            raise UserError("iwslt14 needs raw_dir= a folder with {train,valid,test}.{de,en}; "
                            "see lconv/data/sources.py")
        return {split: self._generate_examples(prefix)
                for split, prefix in (("train", "train"), ("validation", "valid"), ("test", "test"))}

    def _generate_examples(self, prefix: str) -> Iterator[tuple[str, dict]]:
        paths = {lang: os.path.join(self._raw_dir, f"{prefix}.{lang}") for lang in ("de", "en")}
        for path in paths.values():
            if not os.path.exists(path):
                raise UserError(f"raw_dir is missing {path}; it needs {{train,valid,test}}.{{de,en}}")
        with open(paths["de"], encoding="utf-8") as f_de, open(paths["en"], encoding="utf-8") as f_en:
            de_lines, en_lines = f_de.read().splitlines(), f_en.read().splitlines()
        if len(de_lines) != len(en_lines):
            raise UserError(f"{paths['de']} has {len(de_lines)} lines but {paths['en']} {len(en_lines)}; "
                             "the files must be line-aligned")
        for i, (de, en) in enumerate(zip(de_lines, en_lines)):
            yield i, {"de": de.strip(), "en": en.strip()}


BUILDERS = {"ddtp": Ddtp, "iwslt14": Iwslt14}


def prepare(name: str, data_dir: str, raw_dir: str | None = None) -> tfds.core.DatasetBuilder:
    """Prepares ``name`` ("ddtp/en_de", "iwslt14/de_en") as array_record in data_dir unless already there."""
    builder_name, _, config = name.partition("/")
    if builder_name not in BUILDERS or not config:
        raise UserError(f"name={name!r} is not a local builder; use one of "
                         f"{[f'{b}/{c.name}' for b, cls in BUILDERS.items() for c in cls.BUILDER_CONFIGS]}")
    builder = BUILDERS[builder_name](config=config, data_dir=os.path.expanduser(data_dir), raw_dir=raw_dir,
                                     file_format=tfds.core.FileFormat.ARRAY_RECORD)
    if not builder.is_prepared():
        builder.download_and_prepare()
    return builder
