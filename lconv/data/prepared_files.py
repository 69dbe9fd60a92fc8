"""A prepared tfds copy's files, checked before tfds opens any of them: a copy in a data_dir a run's config names
may come from elsewhere, and tfds trusts what its JSON says (docs/security.md)."""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import string
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from etils import epath

from lconv import json_text
from lconv.data import paths
from lconv.errors import UserError

JSON_LIMIT = 16 << 20  # bytes: a copy's dataset_info.json and features.json are a few kB; tfds reads them whole
FEATURES_LIMIT = 1 << 20  # bytes of features.json: a few text fields (tfds parses it into feature objects, slowly)
_PATCH_LOCK = threading.RLock()  # two threads opening copies at once restore tfds's resolver in order
_REMEDY = "remove the copy to prepare it again"
TEMPLATE_FIELDS = frozenset({"DATASET", "SPLIT", "FILEFORMAT", "SHARD_INDEX", "NUM_SHARDS", "SHARD_X_OF_Y"})
MAX_FIELDS = 16  # text fields a copy's examples may hold: lconv's datasets have two to four


def check_tree(copy_dir: str) -> None:
    """Each file a regular file inside ``copy_dir`` (no links, pipes or devices), its JSON of a size tfds may read
    whole, folders plain and a few deep; else one line. What the JSON names is checked where tfds uses it
    (``no_feature_imports``, ``check_split_files``), whatever its spelling."""
    for folder, subfolders, files in os.walk(copy_dir):  # links to folders are listed, never followed
        if os.path.relpath(folder, copy_dir).count(os.sep) >= paths.MAX_FOLDER_DEPTH:
            raise UserError(f"{copy_dir}: folders nested deeper than {paths.MAX_FOLDER_DEPTH} in the prepared copy; "
                            f"lconv's copies are a few folders deep ({_REMEDY})")
        for name in subfolders:
            if os.path.islink(os.path.join(folder, name)):
                raise UserError(f"{os.path.join(folder, name)}: a link in the prepared copy {copy_dir}; prepared "
                                f"copies hold plain folders and files ({_REMEDY})")
        for name in files:
            limit = FEATURES_LIMIT if name == "features.json" else JSON_LIMIT if name.endswith(".json") else None
            paths.check_file(os.path.join(folder, name), within=copy_dir, limit=limit)
            if name == "dataset_info.json":
                _check_templates(os.path.join(folder, name))


def _check_templates(info_path: str) -> None:
    """Each split's file template names only tfds's own fields, plainly: tfds formats it with ``str.format``, so a
    format spec (``{DATASET:>1000000000}``) built a 1 GB name from a 1 kB file, and an attribute reached objects."""
    data = paths.read_bytes(epath.Path(info_path), "missing", limit=JSON_LIMIT)
    try:
        info = json_text.loads(data)
    except ValueError:
        return  # tfds's own parse refuses it, in one line where the copy is opened
    splits = info.get("splits") if isinstance(info, dict) else None
    for split in splits if isinstance(splits, list) else []:
        for key in ("filepathTemplate", "filepath_template"):
            template = split.get(key) if isinstance(split, dict) else None
            if template is None:
                continue
            try:
                parts = list(string.Formatter().parse(str(template)))
            except ValueError:
                parts = [("", "?", "", None)]
            if any(field is not None and (field not in TEMPLATE_FIELDS or spec or conversion)
                   for _, field, spec, conversion in parts):
                raise UserError(f"{info_path}: a split's file template {str(template)[:80]!r} holds more than tfds's "
                                f"plain fields ({', '.join(sorted(TEMPLATE_FIELDS))}); {_REMEDY}")


@contextlib.contextmanager
def no_feature_imports(copy_dir: str) -> Iterator[None]:
    """While tfds opens a copy: a feature class it is not already registered (tfds's own) is refused, never
    imported. tfds imports the module of any class name a features.json gives, in any of its spellings (a current
    or legacy key, JSON inside a string), so the guard sits where tfds turns a name into a class."""
    from tensorflow_datasets.core.features import feature

    connector = feature.FeatureConnector

    def registered_only(cls: type, python_class_name: str) -> type:
        if python_class_name not in connector._registered_features:  # noqa: SLF001 (tfds's own registry)
            raise UserError(f"{copy_dir}: its features name the class {str(python_class_name)[:80]!r}, which tfds "
                            f"would import; a prepared copy names only tfds's own feature classes ({_REMEDY})")
        return resolve.__func__(cls, python_class_name)

    with _PATCH_LOCK:  # the resolver read and replaced under the lock: a nested or concurrent use restores in order
        resolve = connector.__dict__["cls_from_name"]
        connector.cls_from_name = classmethod(registered_only)
        try:
            yield
        finally:
            connector.cls_from_name = resolve


def check_split_files(builder: Any, copy_dir: str) -> None:
    """Every file the builder will read for its splits is a regular file inside ``copy_dir``: the paths tfds
    expands from the info's name, config and templates (a name or a template of ``../..`` read files outside)."""
    for split in builder.info.splits.values():
        for path in split.filepaths:
            if not os.path.lexists(str(path)):
                raise UserError(f"{path}: missing from the prepared copy {copy_dir} (its dataset_info.json lists "
                                f"it for split {split.name!r}; {_REMEDY})")
            paths.check_file(str(path), within=copy_dir)


def check_text_features(builder: Any, keys: list[str], copy_dir: str) -> None:
    """A copy's features are text and hold the fields lconv reads: tfds decodes every field of an example it serves,
    and any other feature type runs another decoder on the copy's bytes (an image's, PIL)."""
    from tensorflow_datasets.core import features as tfds_features

    features = builder.info.features
    if not isinstance(features, tfds_features.FeaturesDict):
        raise UserError(f"{copy_dir}: its features are a {type(features).__name__}, not fields of text ({_REMEDY})")
    fields, leaves = list(features.items()), 0
    while fields:
        name, feature = fields.pop()
        if isinstance(feature, tfds_features.FeaturesDict):
            fields += [(f"{name}/{key}", inner) for key, inner in feature.items()]
        elif type(feature) is not tfds_features.Text:
            raise UserError(f"{copy_dir}: its feature {str(name)[:80]!r} is a {type(feature).__name__}; lconv's "
                            f"datasets hold text only ({_REMEDY})")
        else:
            leaves += 1
        if leaves + len(fields) > MAX_FIELDS:  # tfds decodes every field of every example, read or not
            raise UserError(f"{copy_dir}: its features hold more than {MAX_FIELDS} fields; lconv's datasets have a "
                            f"few ({_REMEDY})")
    missing = [key for key in keys if key not in features.keys()]
    if missing:
        raise UserError(f"{copy_dir}: its features lack {missing} (it has {sorted(features.keys())[:8]}); "
                        f"{_REMEDY}")


def check_no_links(root: str, folder: str) -> None:
    """No folder from ``root`` down to ``folder`` is a link: a version folder linked elsewhere was read whole."""
    relative = os.path.relpath(folder, root)
    if relative.startswith(".."):
        raise UserError(f"{folder}: outside {root}")
    current = root
    for part in [] if relative == "." else relative.split(os.sep):
        current = os.path.join(current, part)
        if os.path.islink(current):
            raise UserError(f"{current}: a link in the prepared data under {root}; prepared copies are plain "
                            f"folders ({_REMEDY})")


def read_through_held_files(source: Any, copy_dir: str, data_dir: str) -> Any:
    """tfds's array_record ``source`` reading each shard through a file opened now, held open while the source
    lives: the copy's folder is entered from ``data_dir`` without following a link and each shard opened in it,
    so a folder or shard swapped for a link after the checks is never what is read (Linux's ``/proc/self/fd``
    reopens the file held, whatever its name points at later). Elsewhere, ``source`` unchanged."""
    if paths.is_url(copy_dir) or not os.path.isdir("/proc/self/fd"):
        return source
    from array_record.python import array_record_data_source
    from tensorflow_datasets.core.data_sources import base

    listed = base.file_instructions(source.dataset_info, source.split)
    _allow_open_files(2 * len(listed))  # each shard held, then opened again by its reader
    held: list[int] = []
    inside = not paths.is_url(data_dir) and paths.is_within(copy_dir, data_dir)
    folder_fd = paths.open_folder_below(data_dir if inside else copy_dir, copy_dir)  # else lconv's own mirror
    try:
        instructions = []
        for instruction in listed:
            name = os.path.relpath(instruction.filename, copy_dir)
            held.append(paths.open_in_folder(folder_fd, name, instruction.filename))
            instructions.append(dataclasses.replace(instruction, filename=f"/proc/self/fd/{held[-1]}"))
        reader = array_record_data_source.ArrayRecordDataSource(instructions)
    except OSError as err:
        _close_all(held)
        if err.errno not in (errno.EMFILE, errno.ENFILE):
            raise
        raise UserError(f"{copy_dir}: its split {source.split!r} lists {len(listed):,} shards, more files than this "
                        "process may hold open (ulimit -n); raise the limit, or prepare it in fewer shards") from None
    except BaseException:
        _close_all(held)
        raise
    finally:
        os.close(folder_fd)
    weakref.finalize(reader, _close_all, held)  # the files close with the reader that reads them
    source.data_source = reader
    return source


def _allow_open_files(more: int) -> None:
    """The soft limit on open files raised towards the hard one when ``more`` files, and a margin, would pass it."""
    import resource  # POSIX only, as /proc is

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = len(os.listdir("/proc/self/fd")) + more + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY
                                                        else min(wanted, hard), hard))


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
