"""Dataset names -> random-access sources: the bundled DDTP tasks, the paper's datasets and your own files.

``get_source(name, split, data_dir)`` gives ``(source, input_key, target_key)`` (``input_key`` None for language
modelling); a source is ``tfds.data_source``-style (``len``, ``source[i] -> {field: bytes}``), read from array_record
with no TensorFlow. ``ddtp/*`` and ``iwslt14/*`` are prepared on first use, the paper's datasets with ``python -m
lconv.data prepare``. Details: docs/data.md.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Protocol

from etils import epath

from lconv import console, shared_folders
from lconv.data import copy_report, ddtp, own_files, paths, prepared_files
from lconv.data.data_config import DataConfig
from lconv.errors import UserError, first_line


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
FILES = "files"  # config.data.dataset: your own files in config.data.raw_dir (lconv.data.own_files)
_FILES_BUILDER = "files/data"


def dataset_spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise UserError(f"dataset={name!r} is unknown; use one of {sorted(DATASETS)}, or {FILES!r} for your own "
                        "files in data.raw_dir (README, \"Train on your own data\")")
    return DATASETS[name]


def files_layout(config: DataConfig) -> own_files.FileLayout | None:
    """How your own files read (a ``DataConfig`` whose dataset is ``files``); None for any other dataset."""
    if config.dataset != FILES:
        return None
    if config.raw_dir is None:
        raise UserError("config.data.dataset='files' reads your files from config.data.raw_dir: set it to their folder "
                        "(README, \"Train on your own data\")")
    if config.source_lang is not None and config.target_lang is None:
        raise UserError(f"config.data.source_lang={config.source_lang!r} needs config.data.target_lang (the other "
                        "side of each pair)")
    if config.source_lang is not None and config.source_lang == config.target_lang:
        raise UserError(f"config.data.source_lang and target_lang are both {config.source_lang!r}; name the two "
                        "sides apart (e.g. src and tgt)")
    folder = paths.normalize(config.raw_dir)
    name = config.name or paths.basename(folder)
    return own_files.FileLayout(folder, config.source_lang, config.target_lang, config.stream, name,
                                ("train", *config.eval_splits))


def config_spec(config: DataConfig) -> DatasetSpec:
    """The ``DatasetSpec`` of a ``DataConfig``'s dataset, your own files' included."""
    return _spec(config.dataset, files_layout(config))


def check_before_writing(config: DataConfig) -> None:
    """What train.py checks of the data before it writes anything in a new workdir: the dataset names one
    (``config_spec``), no other user can change the way to a local data_dir, and a raw_dir is a folder no other user
    can change (as preparing or reading a copy would check later, after the workdir was made)."""
    config_spec(config)
    data_dir = _data_dir(config.data_dir)
    if not paths.is_url(data_dir):
        shared_folders.check_way(data_dir, f"config.data.data_dir={config.data_dir}")
    if config.raw_dir is not None and not paths.is_url(config.raw_dir):  # as preparing from it checks it
        raw_dir = paths.normalize(config.raw_dir)
        if not os.path.isdir(raw_dir):
            raise UserError(f"config.data.raw_dir={config.raw_dir}: no such folder; name the folder of the raw files")
        shared_folders.check_source_folder(raw_dir, f"config.data.raw_dir={raw_dir}")


def display_name(config: DataConfig) -> str:
    """What logs call a ``DataConfig``'s dataset: its name, or for your own files data.name, else the folder's."""
    layout = files_layout(config)
    return config.dataset if layout is None else layout.name


def config_source(config: DataConfig, split: str) -> tuple[Source, str | None, str]:
    """``get_source`` for a ``DataConfig``."""
    return get_source(config.dataset, split, config.data_dir, config.raw_dir, layout=files_layout(config))


def config_is_prepared(config: DataConfig) -> bool:
    """Whether reading ``config``'s dataset writes nothing under its data_dir: a catalog dataset is only ever read
    (``tfds build`` prepares it), a local one (ddtp/*, iwslt14/*, your files) when its copy is complete there."""
    layout = files_layout(config)
    spec = _spec(config.dataset, layout)
    if not spec.local:
        return True
    from lconv.data import tfds_ddtp

    return tfds_ddtp.is_prepared(spec.tfds_name, paths.expand(config.data_dir), config.raw_dir, layout)


def config_report(config: DataConfig) -> dict:
    """``source_report`` for a ``DataConfig``."""
    return source_report(config.dataset, config.data_dir, config.raw_dir, layout=files_layout(config))


def config_data_path(config: DataConfig) -> str:
    """``prepared_data_path`` for a ``DataConfig``."""
    return prepared_data_path(config.dataset, config.data_dir, config.raw_dir, layout=files_layout(config))


def prepare_command(tfds_name: str, data_dir: str) -> str:
    """The command that prepares a catalog dataset (``lconv.data.catalog``), and ``tfds build``'s equivalent."""
    name = next((n for n, spec in DATASETS.items() if spec.tfds_name == tfds_name and not spec.local), tfds_name)
    return (f"python -m lconv.data prepare {name} --data_dir={data_dir} (where there is network; it needs pip "
            f"install tensorflow-cpu; the same as: tfds build {tfds_name} --data_dir={data_dir} "
            "--file_format=array_record, which needs importlib_resources too)")


def _data_dir(data_dir: str) -> str:
    """``data_dir`` made absolute (``paths.normalize``); a local one under a file is one line, not tfds'
    NotADirectoryError."""
    given, data_dir = data_dir, paths.normalize(data_dir)  # absolute as text once: opened where it was checked
    if not paths.is_url(data_dir):
        existing = data_dir
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise UserError(f"config.data.data_dir={given}: {existing} is a file, not a directory; name a folder "
                            "where datasets are (or get) prepared")
    return data_dir


def get_source(name: str, split: str, data_dir: str, raw_dir: str | None = None,
               layout: own_files.FileLayout | None = None) -> tuple[Source, str | None, str]:
    """(source, input_key or None, target_key) of dataset ``name``'s split, prepared under data_dir; ``raw_dir``:
    ``ddtp/*``'s apt files or ``iwslt14/*``'s texts; ``layout``: your own files (``name="files"``)."""
    spec = _spec(name, layout)
    tfds_split = dict(spec.split_names).get(split, split)
    data_dir = _data_dir(data_dir)
    builder = _builder(spec, data_dir, raw_dir, layout)
    if tfds_split not in builder.info.splits:
        shown = spec.tfds_name if layout is None else f"{layout.name} ({layout.folder})"
        raise UserError(f"split={split!r} is not in {shown} (has {sorted(builder.info.splits)})")
    not_array_record = UserError(f"{spec.tfds_name} in {data_dir} is not array_record; delete {builder.data_dir} "
                                 f"and prepare it again with: {prepare_command(spec.tfds_name, data_dir)}")
    if getattr(builder.info.file_format, "value", None) != "array_record":  # tfds has other readers (parquet's
        raise not_array_record  # reads whole shards by path, before lconv holds them)
    try:
        source = prepared_files.read_through_held_files(builder.as_data_source(split=tfds_split),
                                                        str(builder.data_dir), data_dir)
    except NotImplementedError:
        raise not_array_record from None
    except UserError:
        raise
    except ValueError as err:  # its info's shard lengths or file list (tfds's slicing, array_record's paths)
        raise UserError(f"{builder.data_dir}: split {split!r} cannot be read as its dataset_info.json lists it "
                        f"({first_line(err, 120)}); delete the copy and prepare it again") from None
    return source, spec.input_key, spec.target_key


def source_report(name: str, data_dir: str, raw_dir: str | None = None,
                  layout: own_files.FileLayout | None = None) -> dict:
    """What preparing dataset ``name`` skipped or altered, as a JSON-able dict (``{}`` for a ``tfds build`` dataset)."""
    spec = _spec(name, layout)
    if not spec.local:
        return {}
    return copy_report.read_report(_builder(spec, _data_dir(data_dir), raw_dir, layout))


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
    return [console.printable(line) for line in lines]  # a copy's report is text from whoever made the copy


def _spec(name: str, layout: own_files.FileLayout | None) -> DatasetSpec:
    if layout is None:
        return dataset_spec(name)
    kind = "lm" if layout.input_key is None else "translation"  # or summarization: the same pairs
    return DatasetSpec(_FILES_BUILDER, layout.input_key, layout.target_key, kind, True)


def _builder(spec: DatasetSpec, data_dir: str, raw_dir: str | None, layout: own_files.FileLayout | None = None):
    builder = _open_builder(spec, data_dir, raw_dir, layout)
    keys = [key for key in (spec.input_key, spec.target_key) if key is not None]
    prepared_files.check_text_features(builder, keys, str(builder.data_dir))
    return builder


def _open_builder(spec: DatasetSpec, data_dir: str, raw_dir: str | None, layout: own_files.FileLayout | None):
    _data_dir(data_dir)  # a file at it or above it: one line
    if spec.local:
        from lconv.data import tfds_ddtp

        if layout is not None:
            return tfds_ddtp.prepare(spec.tfds_name, data_dir, layout=layout)
        return tfds_ddtp.prepare(spec.tfds_name, data_dir, raw_dir=raw_dir)
    if raw_dir is not None:
        raise UserError(f"raw_dir={raw_dir!r} is only read by the ddtp/* and iwslt14/* datasets; {spec.tfds_name} "
                        "is read from data_dir: unset raw_dir")
    return _prepared_builder(spec.tfds_name, data_dir)


def prepared_version_dir(tfds_name: str, data_dir: str) -> epath.Path:
    """The newest finished version folder of ``tfds_name`` under data_dir; else a UserError with the command."""
    paths.check_url(data_dir, "data_dir")
    versions = sorted(epath.Path(data_dir).glob(f"{tfds_name}/*/dataset_info.json"),
                      key=lambda p: [int(x) if x.isdigit() else 0 for x in p.parent.name.split(".")])
    if not versions:
        raise UserError(f"{tfds_name} is not prepared in {data_dir}; prepare it once with: "
                        f"{prepare_command(tfds_name, data_dir)}")
    return versions[-1].parent


def _prepared_builder(tfds_name: str, data_dir: str):
    """A read-only builder of a dataset prepared by ``tfds build`` (no builder code, so no TensorFlow needed)."""
    import tensorflow_datasets as tfds

    version_dir = prepared_version_dir(tfds_name, data_dir)
    if paths.is_url(data_dir) and paths.scheme(data_dir) != "gs":
        raise UserError(f"data_dir={data_dir!r}: array_record (tfds.data_source) reads local files and gs:// only; "
                        f"copy {data_dir}/{tfds_name} to local disk or gs://")
    if paths.is_url(data_dir):  # no local files to check: still nothing imported
        with prepared_files.no_feature_imports(str(version_dir)):
            return tfds.builder_from_directory(str(version_dir))
    # A copy a run's config names may come from elsewhere: checked as lconv's own are, what tfds reads included.
    shared_folders.check(str(version_dir), f"data_dir={data_dir}")
    prepared_files.check_no_links(paths.expand(data_dir), str(version_dir))
    prepared_files.check_tree(str(version_dir))
    try:
        with prepared_files.no_feature_imports(str(version_dir)):
            builder = tfds.builder_from_directory(str(version_dir))
            prepared_files.check_split_files(builder, str(version_dir))
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 (tfds and protobuf raise many types for a copy they cannot read)
        raise UserError(f"{version_dir}: not a prepared copy tfds can read ({type(err).__name__}: "
                        f"{first_line(err, 120)}); prepare it again") from None
    return builder


def prepared_data_path(name: str, data_dir: str, raw_dir: str | None = None,
                       layout: own_files.FileLayout | None = None) -> str:
    """The folder dataset ``name``'s prepared copy is read from; prepares it if need be."""
    return str(_builder(_spec(name, layout), _data_dir(data_dir), raw_dir, layout).data_dir)

