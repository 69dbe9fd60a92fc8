"""tfds builders written as array_record, prepared and read with no TensorFlow installed: ``ddtp`` (a config per task)
and ``iwslt14`` and your own ``files``. ``prepare(name, data_dir)`` writes each copy once, keyed by its source
(``source_fingerprint``), and never modifies it after. The prepared layout: docs/data.md."""
from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping

import tensorflow_datasets as tfds
from etils import epath

from lconv import console, outputs, shared_folders
from lconv.data import copy_guards, copy_report, ddtp, own_files, paths, prepared_files
from lconv.data.copy_report import REPORT_FILENAME
from lconv.errors import UserError, first_line

_TASK_FIELDS = {
    **{task: ("en", task.split("_")[1]) for task in ddtp.TRANSLATION_TASKS},
    "summarize_en": ("document", "summary"),
    "lm_en": ("text",),
}
_CITATION = """@misc{ddtp, title={Debian Description Translation Project}, note={Debian 12 bookworm main, apt
Translation files}}"""


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base of the builders here, reading ``raw_dir`` (ddtp: None is the bundled snapshot) or your files' ``layout``;
    fixes ``code_path``, which tfds 4.9.10 computes through an absent backport."""

    VERSION = tfds.core.Version("1.0.0")

    def __init__(self, *, raw_dir: str | None = None, layout: own_files.FileLayout | None = None, **kwargs):
        self._raw_dir, self._layout = raw_dir, layout
        super().__init__(**kwargs)

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    def _log_download_bytes(self) -> None:  # tfds would name the temporary directory; prepare() says where
        pass

    def _log_download_done(self) -> None:
        pass


class _LocalInfo(tfds.core.DatasetInfo):
    """The builders' DatasetInfo: theirs is never on tfds's bucket, and tfds's lookup there leaves an empty
    ``/tmp/tmp*tfds`` folder behind at each preparation (it makes the folder before finding GCS off)."""

    def initialize_from_bucket(self) -> None:
        pass


class DdtpConfig(tfds.core.BuilderConfig):
    """A DDTP task: its text fields (plus ``md5``, the description the example comes from)."""

    def __init__(self, *, name: str, **kwargs):
        super().__init__(name=name, version=tfds.core.Version("1.0.0"), **kwargs)
        self.fields = _TASK_FIELDS[name]


class Ddtp(_LocalBuilder):
    """DDTP: Debian package descriptions and their human translations (see lconv/data/snapshot/README.md)."""

    RELEASE_NOTES = {"1.0.0": "Debian 12 bookworm main; md5-hash split; de-duplicated, no text across splits."}
    BUILDER_CONFIGS = [DdtpConfig(name=task, description=f"DDTP task {task}") for task in ddtp.TASKS]

    def _info(self) -> tfds.core.DatasetInfo:
        features = {field: tfds.features.Text() for field in (*self.builder_config.fields, "md5")}
        return _LocalInfo(
            builder=self, description=self.__doc__, features=tfds.features.FeaturesDict(features),
            supervised_keys=tuple(self.builder_config.fields) if len(self.builder_config.fields) == 2 else None,
            homepage="https://www.debian.org/international/l10n/ddtp", citation=_CITATION)

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        task = self.builder_config.name
        self.counts = collections.Counter()  # what parsing and building skipped or altered: prepare() saves them
        self.counts_by_split = {split: collections.Counter() for split in ddtp.SPLITS}
        tasks = ddtp.load_tasks(self._raw_dir, tasks=[task], counts=self.counts,
                                counts_by_split=self.counts_by_split)
        if self._raw_dir is None:  # the snapshot holds parsed records: its parse counts were saved beside it
            self.counts.update(copy_report.snapshot_parse_counts(ddtp.task_langs(task)))
        if not tasks[task]["train"]:
            raise UserError(f"raw_dir={self._raw_dir!r} gives no {task} training example "
                            f"(records read: {copy_report.records(self.counts)}); check its Translation files")
        return {split: self._generate_examples(examples)  # tfds cannot write an empty split (tiny corpora)
                for split, examples in tasks[task].items() if examples}

    def _generate_examples(self, examples) -> Iterator[tuple[str, dict]]:
        for i, example in enumerate(examples):
            yield f"{example['md5']}-{i}", example


class Iwslt14(_LocalBuilder):
    """IWSLT14 De-En from local files ``{train,valid,test}.{de,en}`` in ``raw_dir`` (no download)."""

    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="de_en", description="IWSLT14 German-English, local files")]

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict({"de": tfds.features.Text(), "en": tfds.features.Text()})
        return _LocalInfo(builder=self, description=self.__doc__, features=features, supervised_keys=("de", "en"))

    def _split_generators(self, dl_manager):
        del dl_manager
        self.counts = collections.Counter()
        self.counts_by_split = {split: collections.Counter() for split in ddtp.SPLITS}
        return {split: self._generate_examples(prefix)
                for split, prefix in (("train", "train"), ("validation", "valid"), ("test", "test"))}

    def _generate_examples(self, prefix: str) -> Iterator[tuple[str, dict]]:
        files = {lang: paths.join(self._raw_dir, f"{prefix}.{lang}") for lang in ("de", "en")}
        de_lines, en_lines = _read_lines(files["de"]), _read_lines(files["en"])
        if len(de_lines) != len(en_lines):
            raise UserError(f"{files['de']} has {len(de_lines)} lines but {files['en']} {len(en_lines)}; "
                             "the files must be line-aligned")
        for i, (de, en) in enumerate(zip(de_lines, en_lines)):
            yield i, {"de": de.strip(), "en": en.strip()}


class Files(_LocalBuilder):
    """Your own files in a folder: text pairs, TSV or JSON lines (``lconv.data.own_files``)."""

    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="data", description="your files, read as own_files says")]

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict({key: tfds.features.Text() for key in self._layout.keys})
        return _LocalInfo(builder=self, description=f"{self._layout.name}: {self.__doc__}", features=features,
                          disable_shuffling=True)  # file order: hyps line up

    def _split_generators(self, dl_manager):
        del dl_manager
        found = own_files.find_files(self._layout)
        own_files.check_readable(found)  # every split, before any is read
        self.counts, self.counts_by_split = collections.Counter(), {split: collections.Counter() for split in found}
        return {split: self._generate_examples(split, files) for split, files in found.items()}

    def _generate_examples(self, split: str, files: Mapping[str, str]) -> Iterator[tuple[int, dict]]:
        counts = self.counts_by_split[split]
        yield from enumerate(own_files.read_examples(self._layout, files, counts))
        self.counts.update({k: n for k, n in counts.items() if k.startswith("records_")})  # lines read, per file


def _read_lines(path: str) -> list[str]:
    try:  # decoded whole then split: the same lines as text-mode open() gives (splitlines takes \r\n and \r)
        # read as opened, inside its folder: a file swapped for a link out after the fingerprint is refused
        data = paths.read_bytes(epath.Path(path), "missing", within=os.path.dirname(path))
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text ({e}); convert it to UTF-8") from e


BUILDERS = {"ddtp": Ddtp, "iwslt14": Iwslt14, "files": Files}


CACHE_DIRNAME = outputs.PREPARED_DIRNAME  # under data_dir: one directory per (dataset, source) prepared
_IWSLT_FILES = tuple(f"{prefix}.{lang}" for prefix in ("train", "valid", "test") for lang in ("de", "en"))
_DIGESTS: dict[tuple[str, int, int], str] = {}  # (path, size, mtime_ns) -> sha256: each file hashed once


def _builder_class(name: str) -> tuple[type[_LocalBuilder], str]:
    builder_name, _, config = name.partition("/")
    cls = BUILDERS.get(builder_name)
    if cls is None or config not in [c.name for c in cls.BUILDER_CONFIGS]:
        raise UserError(f"name={name!r} is not a local builder; use one of "
                        f"{[f'{b}/{c.name}' for b, cls in BUILDERS.items() for c in cls.BUILDER_CONFIGS]}")
    return cls, config


def _source_files(name: str, raw_dir: str | None, layout: own_files.FileLayout | None = None) -> dict[str, str]:
    """{role: path} of the files ``name`` is prepared from; a missing one is a UserError naming them all."""
    cls, config = _builder_class(name)
    if cls is Files:
        return {paths.basename(path): path for split in own_files.find_files(layout).values()
                for path in split.values()}
    if cls is Ddtp:
        if raw_dir is None:
            return {split: ddtp.snapshot_file(ddtp.SNAPSHOT_DIR, split) for split in ddtp.SPLITS}
        return ddtp.find_task_files(raw_dir, [config])
    if raw_dir is not None:
        paths.check_url(raw_dir, "raw_dir")
    if raw_dir is None or not epath.Path(raw_dir).is_dir():
        raise UserError(f"{name} needs raw_dir= a folder with {{train,valid,test}}.{{de,en}} (got raw_dir="
                        f"{raw_dir!r}); see lconv/data/sources.py")
    missing = [f for f in _IWSLT_FILES if not epath.Path(paths.join(raw_dir, f)).is_file()]
    if missing:
        raise UserError(f"raw_dir={raw_dir!r} has no {', '.join(missing)}; {name} needs {', '.join(_IWSLT_FILES)}")
    return {f: paths.join(raw_dir, f) for f in _IWSLT_FILES}


def _sha256(path: str, within: str | None) -> str:
    """The file's SHA-256, computed once per (path, size, modification time); read only inside ``within``."""
    url = paths.is_url(path)  # a device or a pipe (a link to /dev/zero) is refused as paths.sha256 opens it
    stat = epath.Path(path).stat() if url else os.stat(path)
    key = (path, stat.length, stat.mtime) if url else (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS or (url and not stat.mtime):  # a store that gives no mtime is read every time
        _DIGESTS[key] = paths.sha256(path, within=within)
    return _DIGESTS[key]


def _absolute(path: str) -> str:
    return path if paths.is_url(path) else os.path.abspath(path)


def source_fingerprint(name: str, raw_dir: str | None = None, layout: own_files.FileLayout | None = None) -> dict:
    """What ``name`` is prepared from: the snapshot or raw_dir, each file's name, size and SHA-256; the ``"key"`` (hex)
    names the prepared copy and depends on the contents only (and the layout's reading rules)."""
    cls, _ = _builder_class(name)
    files = _source_files(name, raw_dir, layout)
    folder = raw_dir if layout is None else layout.folder
    if folder is not None and not paths.is_url(folder):
        # hashed here, then listed and parsed again by the builder: another user who could change the folder (add a
        # file the builder would pick, even in a sticky one) would give the copy this name and digests with their
        # data, as a planted copy would. The builders read its top level only, so that is what is checked.
        shared_folders.check_source_folder(folder, f"config.data.raw_dir={folder}")
    for path in files.values():  # a link out of the folder (a run from elsewhere naming it) is never read
        if folder is not None:
            paths.check_file(path, within=folder)
    described = {role: {"file": paths.basename(path), "bytes": paths.size(path), "sha256": _sha256(path, folder)}
                 for role, path in sorted(files.items())}
    identity = {"dataset": name, "version": str(cls.VERSION),
                "files": {role: d["sha256"] for role, d in described.items()}}
    if layout is not None:
        identity["layout"] = layout.identity()
        name, raw_dir = layout.name, layout.folder
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return {"dataset": name, "version": str(cls.VERSION), "key": key,
            "raw_dir": None if raw_dir is None else _absolute(raw_dir),
            "source": "the bundled snapshot" if raw_dir is None else f"raw_dir={_absolute(raw_dir)}",
            "files": described}


def bundled_source_key(name: str) -> str | None:
    """``source_fingerprint(name)["key"]`` where ``name`` is prepared from lconv's bundled snapshot; None otherwise."""
    builder_name = name.partition("/")[0]
    if BUILDERS.get(builder_name) is not Ddtp:
        return None
    return source_fingerprint(name)["key"]


def prepare(name: str, data_dir: str, raw_dir: str | None = None,
            layout: own_files.FileLayout | None = None) -> tfds.core.DatasetBuilder:
    """Prepares ``name`` ("ddtp/en_de", "iwslt14/de_en", "files/data" with ``layout``) as array_record in data_dir
    unless a copy from the same source is there; returns a builder reading that copy (docs/data.md)."""
    cls, config = _builder_class(name)
    data_dir = paths.normalize(data_dir)
    paths.check_url(data_dir, "data_dir")
    fingerprint, copy_name, copy_dir = _copy_of(name, data_dir, raw_dir, layout)
    options = {"raw_dir": raw_dir} if layout is None else {"layout": layout}  # the builder's own arguments
    if paths.is_url(data_dir):
        read_dir = _mirror_url_copy(name, copy_dir, os.path.join(paths.local_cache_dir(), copy_name), options,
                                    fingerprint)
    else:
        read_dir = copy_dir
        _check_copy_folders(copy_dir)  # before anything is written or read through a link
        prepared_here = not _is_complete(copy_dir, name)
        if prepared_here:
            outputs.check_outside_outputs(data_dir, "data_dir")  # a checkpoint step written into fails its manifest
            # tfds writes by path: lconv_prepared swapped for a link mid-write would put the copy where it led
            shared_folders.check_way(data_dir, f"data_dir={data_dir}")
            shared_folders.check(os.path.dirname(copy_dir), f"data_dir={data_dir}")
            try:
                _prepare_copy(name, copy_dir, options, fingerprint)
            except PermissionError as e:
                raise UserError(f"data_dir={data_dir!r} is not writable ({e.strerror}: {e.filename}); "
                                f"{fingerprint['dataset']} "
                                "needs to be prepared there once: use a writable data_dir") from e
    if not paths.is_url(data_dir):
        # a copy already there may be another user's, planted under the name every user's copy takes: data is read
        # only from folders no one else can change, as a run is
        shared_folders.check(copy_dir, f"data_dir={data_dir}")
        _check_copy(copy_dir)  # before tfds opens any of it
    builder = _open_copy(cls, config, read_dir, options)
    # Only in a data_dir this call wrote to, the user's: one a run's config names is read, never added to. Object
    # stores have no symlinks; your own files have no tfds name.
    if not paths.is_url(data_dir) and layout is None and prepared_here:
        _point_plain_readers(data_dir, name, builder.data_dir)
    return builder


def _open_copy(cls: type, config_name: str, read_dir: str, options: dict) -> tfds.core.DatasetBuilder:
    """The builder reading the copy under ``read_dir``; a ``dataset_info.json`` tfds cannot parse is one line."""
    from google.protobuf import json_format

    try:
        with prepared_files.no_feature_imports(read_dir):
            builder = cls(config=config_name, data_dir=read_dir, file_format=tfds.core.FileFormat.ARRAY_RECORD,
                          **options)
    except UserError:
        raise
    except (json_format.ParseError, RecursionError, ValueError) as err:  # ValueError: a fileFormat not array_record
        raise UserError(f"{read_dir}: the prepared copy's dataset_info.json is not what lconv wrote "
                        f"({first_line(err, 120)}); "
                        "remove the copy to prepare it again") from None
    prepared_files.check_split_files(builder, read_dir)
    return builder


def _check_copy_folders(copy_dir: str) -> None:
    """``lconv_prepared`` and the copy's folder are plain folders, not links: checked before a copy is prepared too,
    as a link planted at ``lconv_prepared`` had the copy written where it led."""
    for path in (os.path.dirname(copy_dir), copy_dir):
        if os.path.islink(path):
            raise UserError(f"{path}: a link where lconv keeps its prepared copies; they are plain folders (remove "
                            "it to prepare the data again)")


def _check_copy(copy_dir: str) -> None:
    """A prepared copy holds the plain files lconv wrote, each inside it, its JSON naming nothing outside
    (``prepared_files.check_tree``). A copy in a data_dir a run's config names comes from elsewhere: a pipe in it
    hung eval.py, and a link out of it had eval.py read and score files outside."""
    _check_copy_folders(copy_dir)
    prepared_files.check_tree(copy_dir)


def _copy_of(name: str, data_dir: str, raw_dir: str | None,
             layout: own_files.FileLayout | None) -> tuple[dict, str, str]:
    """``(fingerprint, copy name, copy folder)`` of ``name``'s prepared copy under ``data_dir``."""
    label = name.replace("/", "_") if layout is None else own_files.copy_label(layout)
    if layout is not None and not _may_hold_copy(data_dir, label):  # it will be prepared: refused before hashing
        own_files.check_readable(own_files.find_files(layout))
    fingerprint = source_fingerprint(name, raw_dir, layout)
    copy_name = f"{label}-{fingerprint['key']}"
    return fingerprint, copy_name, paths.join(data_dir, CACHE_DIRNAME, copy_name)


def _may_hold_copy(data_dir: str, label: str) -> bool:
    """Whether ``data_dir`` may hold a copy labelled ``label`` (of a source only hashing its files tells); a URL may."""
    root = os.path.join(data_dir, CACHE_DIRNAME)
    return paths.is_url(data_dir) or (os.path.isdir(root) and any(n.startswith(f"{label}-") for n in os.listdir(root)))


def is_prepared(name: str, data_dir: str, raw_dir: str | None = None,
                layout: own_files.FileLayout | None = None) -> bool:
    """Whether ``prepare`` would find a complete copy of ``name`` under ``data_dir`` (and so build nothing there)."""
    data_dir = paths.normalize(data_dir)
    paths.check_url(data_dir, "data_dir")
    return _is_complete(_copy_of(name, data_dir, raw_dir, layout)[2], name)


def _report_path(copy_dir: str, name: str, version) -> str:
    return paths.join(copy_dir, *name.split("/"), str(version), REPORT_FILENAME)


def _is_complete(copy_dir: str, name: str) -> bool:
    """A copy counts only once its report is there: the report is the last file written (or renamed) into it."""
    return epath.Path(_report_path(copy_dir, name, _builder_class(name)[0].VERSION)).is_file()


def _prepare_copy(name: str, copy_dir: str, options: dict, fingerprint: dict) -> None:
    """Builds the copy in a local directory of this process's own, then renames it to ``copy_dir`` in one step."""
    cls, config = _builder_class(name)
    os.makedirs(os.path.dirname(copy_dir), exist_ok=True)
    temp_dir = paths.unique_temp(copy_dir)  # unique: processes preparing together never share files
    with copy_guards.removed_on_sigterm(temp_dir), contextlib.ExitStack() as cleanup, \
            copy_guards.no_room_is_one_line(name, copy_dir):
        cleanup.callback(shutil.rmtree, temp_dir, ignore_errors=True)
        builder = cls(config=config, data_dir=temp_dir, file_format=tfds.core.FileFormat.ARRAY_RECORD, **options)
        # as tfds does; the name and the raw_dir come from a config, perhaps a run's from elsewhere
        print(console.printable(f"Preparing {fingerprint['dataset']} from {fingerprint['source']} ..."), flush=True)
        with copy_guards.no_progress_bars():
            builder.download_and_prepare()
        report = {**fingerprint, "examples": {split: info.num_examples for split, info in builder.info.splits.items()},
                  **copy_report.counts_report(builder.counts, builder.counts_by_split)}
        _check_unchanged(name, fingerprint, options)
        with open(os.path.join(builder.data_dir, REPORT_FILENAME), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, ensure_ascii=False)
        shutil.rmtree(os.path.join(temp_dir, "downloads"), ignore_errors=True)  # tfds's, empty: nothing to download
        _commit(temp_dir, copy_dir, name)
        print(console.printable(f"Prepared {fingerprint['dataset']} ({report['examples']} examples) in {copy_dir}"),
              flush=True)


def _check_unchanged(name: str, fingerprint: dict, options: dict) -> None:
    """The source files still hold what the copy is named by (hashed again, uncached): a copy is never stored
    under one content's name with another's data (a file edited while it was parsed)."""
    folder = fingerprint["raw_dir"]
    if folder is None:  # the bundled snapshot, inside the package
        return
    files = _source_files(name, options.get("raw_dir"), options.get("layout"))
    if set(files) != set(fingerprint["files"]):  # a file added or removed meanwhile
        changed = sorted(set(files) ^ set(fingerprint["files"]))[0]
        raise UserError(f"{folder}: its {changed} file appeared or went while {fingerprint['dataset']} was prepared "
                        "from it; nothing was kept: prepare it again once the folder is final")
    for role, path in files.items():
        if paths.sha256(path, within=folder) != fingerprint["files"][role]["sha256"]:
            raise UserError(f"{path} changed while {fingerprint['dataset']} was prepared from it; nothing was kept: "
                            "prepare it again once the file is final")


def _commit(temp_dir: str, copy_dir: str, name: str) -> None:
    """Renames a complete local ``temp_dir`` to ``copy_dir``; another process's copy already there is as good."""
    try:
        os.rename(temp_dir, copy_dir)  # atomic; fails when another process renamed its copy there first
    except OSError:
        if not _is_complete(copy_dir, name):
            raise UserError(f"{copy_dir} is an incomplete prepared copy (no {REPORT_FILENAME}); delete it and "
                            "run again") from None


def _mirror_url_copy(name: str, copy_dir: str, local_dir: str, options: dict, fingerprint: dict) -> str:
    """For a URL data_dir: the copy both at ``copy_dir`` and at ``local_dir``; returns ``local_dir``. The local
    mirror is read and uploaded as the stored copy: its folder is checked by ``paths.local_cache_dir``."""
    on_url = _is_complete(copy_dir, name)
    if not _is_complete(local_dir, name):
        if on_url:  # prepared by another machine: fetch it rather than parse again
            os.makedirs(os.path.dirname(local_dir), exist_ok=True)
            temp_dir = paths.unique_temp(local_dir)
            try:
                paths.download_tree(copy_dir, temp_dir)
                _commit(temp_dir, local_dir, name)
            finally:
                shutil.rmtree(temp_dir, ignore_errors=True)
        else:
            _prepare_copy(name, local_dir, options, fingerprint)
    if not on_url:
        try:
            paths.upload_tree(local_dir, copy_dir, commit_last=[REPORT_FILENAME])
        except OSError as e:
            raise UserError(f"data_dir: cannot write {copy_dir} ({type(e).__name__}: {e}); check that data_dir "
                            "is reachable and writable and run again (the upload is redone)") from e
        print(console.printable(f"Stored {fingerprint['dataset']} in {copy_dir}"), flush=True)
    return local_dir


def _point_plain_readers(data_dir: str, name: str, version_dir: str) -> None:
    """Makes ``<data_dir>/<name>/<version>`` a symlink to the copy just prepared, where it can: only through real
    folders, and replacing only a link of lconv's own (into ``CACHE_DIRNAME``), never the user's. Each folder is
    opened without following a link and the link is made in the folder opened, so a folder swapped for a link
    meanwhile is not followed either."""
    try:
        folder_fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        folder = data_dir
        for part in name.split("/"):
            folder = os.path.join(folder, part)
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=folder_fd)
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder_fd)
            except OSError:
                return  # a link or a file: not a folder lconv made, left as it is
            os.close(folder_fd)
            folder_fd = inner
        _link_in(folder_fd, os.path.basename(version_dir), target=os.path.relpath(version_dir, folder),
                 ours=os.path.relpath(os.path.join(data_dir, CACHE_DIRNAME), folder) + os.sep)
    finally:
        os.close(folder_fd)


def _link_in(folder_fd: int, name: str, *, target: str, ours: str) -> None:
    """``name`` in the open folder a link to ``target``, unless something other than a link starting ``ours`` is
    there: a folder, a file or someone else's link."""
    try:
        if not os.readlink(name, dir_fd=folder_fd).startswith(ours):
            return
    except FileNotFoundError:
        pass
    except OSError:  # not a link
        return
    temp = os.path.basename(paths.unique_temp(name))
    try:
        os.symlink(target, temp, dir_fd=folder_fd)
        os.replace(temp, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=folder_fd)
