"""A stand-in object store for tests of URL paths (``gs://``, ``s3://``), with no network: an fsspec file system
over a local folder, registered where gcsfs / s3fs would be (the route etils.epath takes to gs:// when TensorFlow is
absent). Every os-level call on a ``gs:`` path (``open``, ``os.stat``, ``os.makedirs``, ``os.rename``, ...) is
recorded: a single one would mean some code treated the URL as a local path.

Tests ask for it as the ``bucket`` fixture (tests/conftest.py), which runs ``store``."""
from __future__ import annotations

import builtins
import importlib
import os
import pathlib

from etils.epath import backend as epath_backend
from etils.epath import gpath
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from lconv.data import paths

REGISTRY = importlib.import_module("fsspec.registry")  # the module: fsspec.registry is its read-only view
_OS_CALLS = ("stat", "lstat", "listdir", "scandir", "makedirs", "mkdir", "rename", "replace", "symlink", "remove",
             "unlink", "rmdir", "open")


class _Bucket(DirFileSystem):
    """gs:// and s3:// (the stand-ins for gcsfs / s3fs): objects are files under ``root``; like an object store,
    writing a file needs no folder made first."""

    protocol = ("gs", "gcs", "s3", "s3a")
    cachable = False  # a new instance, over the current root, each time epath asks
    root = ""

    def __init__(self, *args, **kwargs):
        super().__init__(path=type(self).root, fs=LocalFileSystem(auto_mkdir=True))


class _Objects(type(pathlib.Path())):
    """The bucket's local folder, with ``os_calls``: the os-level calls made on a gs:// path (should be none)."""

    os_calls: list


def store(tmp_path, monkeypatch):
    """Local folder behind gs:// (and s3://); yields it, with ``.os_calls`` the os calls on URLs."""
    root = _Objects(tmp_path / "objects")
    root.mkdir()
    monkeypatch.setattr(_Bucket, "root", str(root))
    for protocol in ("gs", "gcs", "s3"):
        monkeypatch.setitem(REGISTRY._registry, protocol, _Bucket)
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)  # the fsspec route even if TensorFlow is there
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "mirror"))
    cwd = tmp_path / "cwd"  # a URL taken for a relative local path would land here
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    calls = []

    def recording(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            for arg in args[:2]:
                if isinstance(arg, (str, os.PathLike)) and not isinstance(arg, int) and "gs:/" in os.fspath(arg):
                    calls.append(f"{name}({os.fspath(arg)!r})")
            return real(*args, **kwargs)
        return call

    for name in _OS_CALLS:
        monkeypatch.setattr(os, name, recording(os, name))
    monkeypatch.setattr(builtins, "open", recording(builtins, "open"))
    root.os_calls = calls
    yield root
    epath_backend._FileSystemSpecBackend._get_filesystem.cache_clear()
    assert not os.listdir(cwd), "a URL was written as a relative local path"
