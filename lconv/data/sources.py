"""Dataset names -> random-access sources: the bundled DDTP tasks and the paper's datasets.

One function, ``get_source(name, split, data_dir)``, gives ``(source, input_key, target_key)`` for every task;
``input_key`` is None for language modelling. Sources are ``tfds.data_source``-style: ``len(source)`` and
``source[i] -> {field: bytes}``, read from array_record files with no TensorFlow.

- ``ddtp/*`` and ``iwslt14/*`` are prepared here on first use (seconds; see ``tfds_ddtp``), once per source:
  the bundled snapshot and each raw_dir's files get a copy of their own, keyed by the files' contents.
  ``source_report`` gives what preparing one skipped or altered (a JSON-able dict).
- The paper's datasets (WMT14 En-De/En-Fr, WMT17 Zh-En, Billion Word ``lm1b``, CNN-DailyMail) cannot be
  downloaded on these machines: prepare them where there is network with the command the error gives, e.g.
  ``tfds build wmt14_translate/de-en --data_dir=DIR --file_format=array_record``, and copy DIR here. Unprepared,
  ``get_source`` raises a one-line ValueError saying exactly that.
- IWSLT14 De-En: ``raw_dir`` holds ``{train,valid,test}.{de,en}`` (e.g. fairseq's prepare-iwslt14.sh output
  before BPE); ``get_source("iwslt14/de_en", split, data_dir, raw_dir=...)`` prepares it once.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping
from typing import Any, Protocol

from lconv.data import ddtp
from lconv.errors import UserError


class Source(Protocol):
    """A random-access source: ``len(source)`` examples, ``source[i] -> {field: bytes or str}``."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Mapping[str, Any]: ...


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    tfds_name: str  # "builder/config" as tfds knows it
    input_key: str | None  # None: a language-modelling dataset (targets only)
    target_key: str
    kind: str  # "translation" | "summarization" | "lm"
    local: bool  # prepared by lconv (ddtp, iwslt14) rather than by `tfds build`
    split_names: tuple[tuple[str, str], ...] = ()  # (our split, tfds split) where they differ


def _specs() -> dict[str, DatasetSpec]:
    specs = {}
    for task in ddtp.TRANSLATION_TASKS:
        xx = task.split("_")[1]
        specs[f"ddtp/en_{xx}"] = DatasetSpec(f"ddtp/{task}", "en", xx, "translation", True)
        specs[f"ddtp/{xx}_en"] = DatasetSpec(f"ddtp/{task}", xx, "en", "translation", True)
    specs["ddtp/summarize_en"] = DatasetSpec("ddtp/summarize_en", "document", "summary", "summarization", True)
    specs["ddtp/lm_en"] = DatasetSpec("ddtp/lm_en", None, "text", "lm", True)
    specs["iwslt14/de_en"] = DatasetSpec("iwslt14/de_en", "de", "en", "translation", True)
    specs["iwslt14/en_de"] = DatasetSpec("iwslt14/de_en", "en", "de", "translation", True)
    for src, tgt, tfds_name in (("en", "de", "wmt14_translate/de-en"), ("en", "fr", "wmt14_translate/fr-en"),
                                ("zh", "en", "wmt17_translate/zh-en")):
        year = tfds_name[3:5]
        specs[f"wmt{year}/{src}_{tgt}"] = DatasetSpec(tfds_name, src, tgt, "translation", False)
        specs[f"wmt{year}/{tgt}_{src}"] = DatasetSpec(tfds_name, tgt, src, "translation", False)
    # lm1b has no validation split; the paper reports test perplexity.
    specs["lm1b"] = DatasetSpec("lm1b", None, "text", "lm", False, (("validation", "test"),))
    specs["cnn_dailymail"] = DatasetSpec("cnn_dailymail", "article", "highlights", "summarization", False)
    return specs


DATASETS = _specs()


def dataset_spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise UserError(f"dataset={name!r} is unknown; use one of {sorted(DATASETS)}")
    return DATASETS[name]


def prepare_command(tfds_name: str, data_dir: str) -> str:
    return f"tfds build {tfds_name} --data_dir={data_dir} --file_format=array_record"


def get_source(name: str, split: str, data_dir: str, raw_dir: str | None = None) -> tuple[Source, str | None, str]:
    """(random-access source, input_key or None, target_key) for dataset ``name`` and split train/validation/test.

    raw_dir: for ``ddtp/*`` raw apt Translation files instead of the bundled snapshot; for ``iwslt14/*`` the
    folder of text files. Each source is prepared into a copy of its own under data_dir (``tfds_ddtp.prepare``).
    """
    spec = dataset_spec(name)
    tfds_split = dict(spec.split_names).get(split, split)
    data_dir = os.path.expanduser(data_dir)
    builder = _builder(spec, data_dir, raw_dir)
    if tfds_split not in builder.info.splits:
        raise UserError(f"split={split!r} is not in {spec.tfds_name} (has {sorted(builder.info.splits)})")
    try:
        source = builder.as_data_source(split=tfds_split)
    except NotImplementedError as e:  # prepared in TFRecord format
        raise UserError(f"{spec.tfds_name} in {data_dir} is not array_record; rebuild it with: "
                         f"{prepare_command(spec.tfds_name, data_dir)}") from e
    return source, spec.input_key, spec.target_key


def source_report(name: str, data_dir: str, raw_dir: str | None = None) -> dict:
    """What preparing dataset ``name`` from its source skipped or altered, as a JSON-able dict (``{}`` for the
    datasets ``tfds build`` prepared, which lconv did not parse).

    Keys: ``dataset``, ``source`` (one line: the bundled snapshot or raw_dir=...), ``files`` ({role: {file,
    bytes, sha256}}), ``key``, ``examples`` ({split: n}), ``skipped`` and ``altered`` ({stage: {reason: n}},
    stage ``parse`` or a split), ``records`` ({lang: records parsed}); see ``tfds_ddtp``.
    """
    spec = dataset_spec(name)
    if not spec.local:
        return {}
    from lconv.data import tfds_ddtp

    return tfds_ddtp.read_report(_builder(spec, os.path.expanduser(data_dir), raw_dir))


def describe_report(report: Mapping[str, Any]) -> list[str]:
    """A ``source_report`` as lines for a log: the source, then one line per kind and stage (none if ``{}``)."""
    if not report:
        return []
    lines = [f"{report['dataset']} prepared from {report['source']}: examples {report['examples']}, "
             f"records read {report['records']}"]
    for kind in ("skipped", "altered"):
        for stage, reasons in report[kind].items():
            lines.append(f"{kind} ({stage}): {', '.join(f'{reason} {n}' for reason, n in reasons.items())}")
    if not report["skipped"]:
        lines.append("skipped: nothing")
    return lines


def _builder(spec: DatasetSpec, data_dir: str, raw_dir: str | None):
    if spec.local:
        from lconv.data import tfds_ddtp

        return tfds_ddtp.prepare(spec.tfds_name, data_dir, raw_dir=raw_dir)
    if raw_dir is not None:
        raise UserError(f"raw_dir={raw_dir!r} is only read by the ddtp/* and iwslt14/* datasets; {spec.tfds_name} "
                        "is read from data_dir: unset raw_dir")
    return _prepared_builder(spec.tfds_name, data_dir)


def _prepared_builder(tfds_name: str, data_dir: str):
    """A read-only builder of a dataset prepared by ``tfds build`` (no builder code, so no TensorFlow needed)."""
    import tensorflow_datasets as tfds

    versions = sorted(glob.glob(os.path.join(data_dir, tfds_name, "*", "dataset_info.json")),
                      key=lambda p: [int(x) if x.isdigit() else 0 for x in p.split(os.sep)[-2].split(".")])
    if not versions:
        raise UserError(f"{tfds_name} is not prepared in {data_dir} and cannot be downloaded here; on a machine "
                         f"with network run: {prepare_command(tfds_name, data_dir)} (then copy {data_dir}/"
                         f"{tfds_name.split('/')[0]} here)")
    return tfds.builder_from_directory(os.path.dirname(versions[-1]))
