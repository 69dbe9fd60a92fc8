"""A prepared tfds copy's files, checked before tfds opens any of them: a copy in a data_dir a run's config names
may come from elsewhere, and tfds trusts what its JSON says (docs/security.md)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from lconv import json_text
from lconv.data import paths
from lconv.errors import UserError, first_line

# tfds imports the module a features.json class name gives: only its own feature classes are named in a copy.
FEATURE_MODULE = "tensorflow_datasets.core.features."
JSON_LIMIT = 16 << 20  # bytes: a copy's dataset_info.json and features.json are a few kB
_REMEDY = "remove the copy to prepare it again"


def check_tree(copy_dir: str) -> None:
    """Each file a regular file inside ``copy_dir`` (no links, pipes or devices), folders plain and a few deep, and
    what its JSON names (feature classes, split files) is tfds's own and inside the copy; else one line."""
    for folder, subfolders, files in os.walk(copy_dir):  # links to folders are listed, never followed
        if os.path.relpath(folder, copy_dir).count(os.sep) >= paths.MAX_FOLDER_DEPTH:
            raise UserError(f"{copy_dir}: folders nested deeper than {paths.MAX_FOLDER_DEPTH} in the prepared copy; "
                            f"lconv's copies are a few folders deep ({_REMEDY})")
        for name in subfolders:
            if os.path.islink(os.path.join(folder, name)):
                raise UserError(f"{os.path.join(folder, name)}: a link in the prepared copy {copy_dir}; prepared "
                                f"copies hold plain folders and files ({_REMEDY})")
        for name in files:
            path = os.path.join(folder, name)
            paths.check_file(path, within=copy_dir)
            if name == "features.json":
                _check_feature_classes(path, _read_json(path, copy_dir))
            elif name == "dataset_info.json":
                _check_split_files(path, _read_json(path, copy_dir))


@contextlib.contextmanager
def no_feature_imports(copy_dir: str) -> Iterator[None]:
    """While tfds opens a copy: a feature class it is not already registered (tfds's own) is refused, never
    imported. tfds imports the module of any class name a features.json gives, in any of its spellings (a current
    or legacy key, JSON inside a string), so the guard sits where tfds turns a name into a class."""
    from tensorflow_datasets.core.features import feature

    connector = feature.FeatureConnector
    resolve = connector.__dict__["cls_from_name"]

    def registered_only(cls: type, python_class_name: str) -> type:
        if python_class_name not in connector._registered_features:  # noqa: SLF001 (tfds's own registry)
            raise UserError(f"{copy_dir}: its features name the class {str(python_class_name)[:80]!r}, which tfds "
                            f"would import; a prepared copy names only tfds's own feature classes ({_REMEDY})")
        return resolve.__func__(cls, python_class_name)

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


def _read_json(path: str, copy_dir: str) -> Any:
    data = paths.read_bytes(path, "missing", within=copy_dir, limit=JSON_LIMIT)
    try:
        return json_text.loads(data)
    except ValueError as err:
        raise UserError(f"{path}: not the JSON tfds writes ({first_line(err, 120)}); {_REMEDY}") from None


def _check_feature_classes(path: str, value: Any) -> None:
    """Every ``pythonClassName`` is one of tfds's feature classes: any other is a module tfds would import."""
    if isinstance(value, dict):
        name = value.get("pythonClassName")
        if name is not None and not (isinstance(name, str) and name.startswith(FEATURE_MODULE)):
            raise UserError(f"{path}: names the feature class {str(name)[:80]!r}, which tfds would import; a prepared "
                            f"copy names only {FEATURE_MODULE}* ({_REMEDY})")
        values = value.values()
    elif isinstance(value, list):
        values = value
    else:
        return
    for item in values:
        _check_feature_classes(path, item)


def _check_split_files(path: str, info: Any) -> None:
    """Each split's file template is a bare file name: a template with a folder in it sent tfds outside the copy."""
    splits = info.get("splits", []) if isinstance(info, dict) else []
    for split in splits if isinstance(splits, list) else []:
        template = split.get("filepathTemplate") if isinstance(split, dict) else None
        if template is not None and (not isinstance(template, str) or "/" in template or "\\" in template
                                     or ".." in template):
            raise UserError(f"{path}: split {split.get('name')!r} reads files at {str(template)[:80]!r}; a prepared "
                            f"copy's split files are bare names inside it ({_REMEDY})")
