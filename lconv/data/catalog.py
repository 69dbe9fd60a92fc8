"""Preparing the paper's datasets (tfds catalog builders) as array_record: ``python -m lconv.data prepare NAME``.
Preparing needs TensorFlow (checked first, in one line), reading does not; a URL data_dir is staged locally and uploaded
with ``dataset_info.json`` last. docs/data.md."""
from __future__ import annotations

import importlib
import importlib.resources
import importlib.util
import logging
import os
import shutil
import sys
import tempfile

from etils import epath

from lconv import shared_folders
from lconv.data import paths, sources
from lconv.errors import UserError

logger = logging.getLogger(__name__)

# Why each catalog builder needs TensorFlow to prepare (docs/data.md); its module, which tfds without
# TensorFlow does not import (so does not register) by itself.
TENSORFLOW_NEEDED = {
    "wmt14_translate": "tfds unpacks its .tgz downloads with tf.io.gfile",
    "wmt17_translate": "tfds unpacks its .tgz downloads with tf.io.gfile",
    "lm1b": "tfds unpacks its .tar.gz with tf.io.gfile and the builder lists it with tf.io.gfile.glob",
    "cnn_dailymail": "tfds unpacks its .tgz with tf.io.gfile and the builder reads it with tf.io.gfile",
}
_MODULES = {
    "wmt14_translate": "tensorflow_datasets.translate.wmt14",
    "wmt17_translate": "tensorflow_datasets.translate.wmt17",
    "cnn_dailymail": "tensorflow_datasets.summarization.cnn_dailymail",
}
INSTALL = "pip install tensorflow-cpu"  # any TensorFlow 2 works; the CPU wheel is the smallest


def has_tensorflow() -> bool:
    return importlib.util.find_spec("tensorflow") is not None


def prepared_dir(tfds_name: str, data_dir: str) -> str | None:
    """The newest prepared version of ``tfds_name`` under data_dir (its ``dataset_info.json`` present), or None."""
    try:
        return str(sources.prepared_version_dir(tfds_name, data_dir))
    except UserError:
        return None


def prepare(name: str, data_dir: str, *, download_dir: str | None = None, manual_dir: str | None = None) -> str:
    """Prepares catalog dataset ``name`` as array_record under data_dir unless there; returns its version folder."""
    spec = sources.dataset_spec(name)
    if spec.local:
        raise UserError(f"{name} is prepared by lconv itself (lconv.data.tfds_ddtp.prepare), not from the catalog")
    data_dir = paths.normalize(data_dir)
    paths.check_url(data_dir, "--data_dir")
    done = prepared_dir(spec.tfds_name, data_dir)
    if done is not None:
        logger.info(f"{spec.tfds_name} is already prepared in {done}")
        return done
    builder_name = spec.tfds_name.split("/")[0]
    if not paths.is_url(data_dir):  # tfds writes by path: a folder swapped for a link would move what it writes
        shared_folders.check_way(data_dir, f"--data_dir={data_dir}")
        shared_folders.check(os.path.join(data_dir, builder_name), f"--data_dir={data_dir}")
        downloads = download_dir or os.path.join(data_dir, "downloads")
        label = f"--download_dir={download_dir}" if download_dir else f"--data_dir={data_dir}"
        shared_folders.check_way(downloads, label)
        if os.path.isdir(downloads):  # tfds reads what is there back by path: a planted archive or extracted file
            shared_folders.check(downloads, label)
    else:  # downloads read back by path, and the build staged in a new owner-only folder beside them, uploaded
        download_dir = download_dir or os.path.join(paths.local_cache_dir(), "downloads")
        label = f"the local staging of --data_dir={data_dir}"
        shared_folders.check_way(os.path.dirname(os.path.abspath(download_dir)), label)  # not all else it holds
        paths.private_folder(download_dir, label)
    if manual_dir and not paths.is_url(manual_dir):  # read by path into the copy, as the downloads are
        shared_folders.check(manual_dir, f"--manual_dir={manual_dir}")
    if not has_tensorflow():
        raise UserError(f"preparing {name} needs TensorFlow ({TENSORFLOW_NEEDED.get(builder_name, 'tfds')}): "
                        f"{INSTALL}, then run this again (training reads it without TensorFlow)")
    staging = None
    if paths.is_url(data_dir):  # downloads kept locally (a rerun resumes them); the build staged beside them
        os.makedirs(download_dir, exist_ok=True)
        staging = tempfile.mkdtemp(prefix="lconv_prepare_", dir=os.path.dirname(os.path.abspath(download_dir)))
    try:
        builder = _catalog_builder(spec.tfds_name, staging or data_dir)
        logger.info(f"Preparing {spec.tfds_name} in {staging or data_dir} (downloads: "
                    f"{download_dir or os.path.join(data_dir, 'downloads')}) ...")
        _download_and_prepare(builder, name, download_dir, manual_dir)
        if staging is not None:  # array_record writes local files only: upload, dataset_info.json last
            target = paths.join(data_dir, *spec.tfds_name.split("/"), epath.Path(builder.data_dir).name)
            try:
                paths.upload_tree(str(builder.data_dir), target, commit_last=["dataset_info.json"])
            except OSError as e:
                raise UserError(f"cannot write {target} ({type(e).__name__}: {e}); check that --data_dir is "
                                "reachable and writable and run again (the downloads are kept)") from e
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    done = str(sources.prepared_version_dir(spec.tfds_name, data_dir))
    logger.info(f"Prepared {spec.tfds_name} in {done}")
    return done


def _catalog_builder(tfds_name: str, data_dir: str):
    import tensorflow_datasets as tfds

    if importlib.util.find_spec("importlib_resources") is None:  # tfds imports it (docs/data.md)
        sys.modules.setdefault("importlib_resources", importlib.resources)
    module = _MODULES.get(tfds_name.split("/")[0])
    if module is not None:
        importlib.import_module(module)  # registers the builder
    return tfds.builder(tfds_name, data_dir=data_dir)


def _download_and_prepare(builder, name: str, download_dir: str | None, manual_dir: str | None) -> None:
    import requests
    import tensorflow_datasets as tfds

    config = tfds.download.DownloadConfig(manual_dir=manual_dir)
    try:
        builder.download_and_prepare(file_format="array_record", download_dir=download_dir, download_config=config)
    except PermissionError as e:
        raise UserError(f"cannot write {e.filename} ({e.strerror}); pass a writable --data_dir / --download_dir") \
            from e
    except (tfds.download.DownloadError, requests.RequestException, ConnectionError) as e:
        detail = " ".join(str(e).split())[:300]
        raise UserError(f"downloading {name} failed ({type(e).__name__}: {detail}); run this where there is "
                        "network (a rerun keeps the downloads that finished)") from e
