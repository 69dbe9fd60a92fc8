"""Reading an export back (``lconv.export.load``): each file named by the sidecar, checked before it is used, so a
damaged, edited or hostile export is one line naming the file and what is wrong, never a traceback, a hang or a
decompression that takes all memory."""
from __future__ import annotations

import hashlib
import io
import json
import re
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import traverse_util

from lconv import json_text
from lconv.constants import EXPORT_SIDECAR as SIDECAR
from lconv.data import paths
from lconv.errors import UserError, first_line
from lconv.run import integrity, schema

FORMAT_VERSION = 1


def read_part(directory: epath.Path, name: str, parse: Any, what: str, limit: int = paths.READ_LIMIT,
              sha256: str | None = None) -> Any:
    """``parse(bytes of directory/name)``; a missing, unreadable or damaged file is one line naming it, and so is
    one over ``limit`` bytes or one whose bytes are not those the sidecar's ``sha256`` recorded."""
    path = directory / name
    data = paths.read_bytes(path, f"missing from the export (listed in its {SIDECAR}); export the run again",
                            within=directory, limit=limit)
    check_digest(path, data, sha256)
    try:
        return parse(data)
    except Exception as err:  # noqa: BLE001 (whatever a damaged file makes its parser raise, the file is to blame)
        reason = first_line(err)
        raise UserError(f"{path}: not {what} ({reason}); the file is damaged: export the run again") from None


def check_digest(path: epath.Path, data: bytes, sha256: str | None) -> None:
    """A file whose bytes changed since the export wrote them is one line: a flipped byte in a program can
    deserialise and run, or fail only at the first call (sidecars written before digests are not checked)."""
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise UserError(f"{path}: its bytes differ from those the export wrote (its sha256 in {SIDECAR}); the "
                        "file was altered or damaged: export the run again")


# The sidecar's fields, each with the JSON type it holds ("integer": a JSON number without a fraction, never
# true/false); those not required are informative. A program entry's fields likewise.
SIDECAR_FIELDS = {"format": "integer", "task": "string", "tokenizer": "string", "params": "string",
                  "programs": "array", "search": "object"}
OPTIONAL_FIELDS = {"workdir": "string", "steps": "array", "platforms": "array", "conv_impl": "object",
                   "guards": "object", "ids": "object", "jax_version": "string", "config": "object",
                   "sha256": "object"}
PROGRAM_FIELDS = {"file": "string", "rows": "integer", "width": "integer"}
OPTIONAL_PROGRAM_FIELDS = {"output_len": "integer"}
_TYPES = {"integer": int, "string": str, "array": list, "object": dict}
_ARTICLE = {"integer": "an", "string": "a", "array": "an", "object": "an"}


def check_types(record: Any, required: dict[str, str], optional: dict[str, str], where: str = "") -> None:
    """Each field of ``record`` (a JSON object) holds its JSON type, a required one is there: a ``ValueError``
    naming the field and the type otherwise (``"rows": true`` was a TypeError traceback at the first call)."""
    if not isinstance(record, dict):
        raise ValueError(f"{where.rstrip('.') or 'the sidecar'} is {_json_type(record)}, where an object belongs")
    for name, kind in {**required, **optional}.items():
        if name not in record:
            if name in required:
                raise ValueError(f"no {where}{name} ({_ARTICLE[kind]} {kind})")
            continue
        value = record[name]
        if isinstance(value, bool) or not isinstance(value, _TYPES[kind]):
            raise ValueError(f"{where}{name} is {_json_type(value)} ({json.dumps(value)[:40]}), where "
                             f"{_ARTICLE[kind]} {kind} belongs")


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def parse_sidecar(data: bytes) -> dict[str, Any]:
    """The sidecar: its fields of their types (``check_types``, in one place), its files plain names, its search
    settings the ones the programs were lowered with; a ``ValueError`` naming what is wrong otherwise."""
    sidecar = json_text.loads(data)
    check_types(sidecar, SIDECAR_FIELDS, OPTIONAL_FIELDS)
    if sidecar["format"] != FORMAT_VERSION:
        raise ValueError(f"format {sidecar['format']!r}, where this lconv reads format {FORMAT_VERSION}")
    if sidecar["task"] not in ("translation", "summarization", "lm"):
        raise ValueError(f"task {sidecar['task']!r}")
    if not sidecar["programs"]:
        raise ValueError("no programs")
    buckets: dict[Any, int] = {}
    for i, program in enumerate(sidecar["programs"]):
        check_types(program, PROGRAM_FIELDS, OPTIONAL_PROGRAM_FIELDS, f"programs[{i}].")
        if program["rows"] < 1 or program["width"] < 1:
            raise ValueError(f"programs[{i}] has rows {program['rows']} and width {program['width']}; both are >= 1")
        # One entry per bucket and per file: a repeated one was read and deserialised again each time (a sidecar
        # repeating one program 100,000 times kept lconv.export.load busy for minutes).
        for key in ((program["rows"], program["width"]), program["file"]):
            if key in buckets:
                raise ValueError(f"programs[{i}] repeats programs[{buckets[key]}]'s "
                                 f"{'file' if isinstance(key, str) else 'rows and width'}")
            buckets[key] = i
    names = [sidecar["tokenizer"], sidecar["params"]] + [p["file"] for p in sidecar["programs"]]
    for name in names:
        if not is_file_name(name):
            raise ValueError(f"it names {name!r}: an export's files are plain names inside its folder")
    for name, digest in sidecar.get("sha256", {}).items():
        if name not in names or not isinstance(digest, str) or not re.fullmatch("[0-9a-f]{64}", digest):
            raise ValueError(f"sha256[{name!r}] is not a SHA-256 in hex of one of the files it names")
    search, needed = sidecar["search"], "max_len" if sidecar["task"] == "lm" else "lenpen"
    if needed not in search:
        raise ValueError(f"no search.{needed}")
    if needed == "max_len":
        schema.check_sampling(search)  # the settings the programs were lowered with
    else:
        schema.check_search(beam_size=search.get("beam_size"), lenpen=search["lenpen"],
                            spell=lambda name: f"search.{name}")
    return sidecar


def is_file_name(name: str) -> bool:
    """A bare file name (what export writes): no folder, no ``..``, no absolute path, on any platform."""
    return bool(name) and name not in (".", "..") and not any(c in name for c in "/\\:\0")


NPY_HEADER_BYTES = 4096  # a .npy member's header: a magic string and a dict of dtype, order and shape


def params_limit(exported: jax.export.Exported) -> tuple[int, int]:
    """``(leaves, bytes)`` of the params ``exported`` takes (its first argument): what a params.npz holds, less
    each member's header."""
    avals = exported.in_avals[:exported.in_tree.children()[0].children()[0].num_leaves]
    return len(avals), sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in avals)


def parse_params(data: bytes, leaves: int | None = None, size: int | None = None) -> Any:
    """The params in a .npz, refused before anything is decompressed when its zip directory declares more
    members than ``leaves`` or more bytes than ``size`` and their headers (a zip bomb: a small file of zeros that
    decompresses to all memory), or a member whose header claims more values than the member holds."""
    arrays, declared = paths.npz_directory(data)
    if leaves is not None and arrays > leaves:
        raise ValueError(f"{arrays} arrays, where the programs take {leaves}")
    if size is not None and declared > size + NPY_HEADER_BYTES * arrays:
        raise ValueError(f"its arrays decompress to {declared:,} bytes (the zip directory says), where the "
                         f"programs' params take {size:,}")
    with np.load(io.BytesIO(data), allow_pickle=False) as flat:
        return traverse_util.unflatten_dict({k: flat[k] for k in flat.files}, sep="/")


def check_finite_params(params: Any, params_path: epath.Path) -> None:
    """Params with a NaN or inf decode every input to an empty output without an error: one line naming the first
    such array instead (one pass over arrays already in memory)."""
    where = integrity.first_non_finite(params)
    if where is not None:
        raise UserError(f"{params_path}: {where} holds NaN or inf values (a diverged or damaged model); export the "
                        "run again from a checkpoint with finite params")


def parse_program(data: bytes) -> jax.export.Exported:
    """A serialised program whose native calls are all ones jax itself exports: a program calling anything else (a
    Python host callback's handler, indexed by a number in the file) crashed the process at its first call."""
    exported = jax.export.deserialize(bytearray(data))
    called = set(_CUSTOM_CALL.findall(exported.mlir_module()))
    called = {name for pair in called for name in pair if name}
    unknown = sorted(called - _stable_targets())
    if unknown:
        raise ValueError(f"it calls the native target {unknown[0][:80]!r}, which no program jax exports holds")
    carried = sorted(called & _KERNEL_CARRYING)
    if carried:
        raise ValueError(f"it calls {carried[0]!r}, which runs a kernel the file itself carries; lconv's exports "
                         "hold none (export the run again)")
    return exported


# Stable targets whose operand is code from the file (a Pallas/Mosaic kernel, a TensorFlow function): loading one
# from a handed-over export would run that code on the device.
_KERNEL_CARRYING = frozenset({"tpu_custom_call", "mosaic_gpu", "mosaic_gpu_v2", "tf.call_tf_function",
                              "triton_kernel_call", "__gpu$xla.gpu.triton"})


_CUSTOM_CALL = re.compile(r'stablehlo\.custom_call @([\w.$\-]+)|call_target_name = "([^"]*)"')


def _stable_targets() -> frozenset[str]:
    """The native calls ``jax.export`` lets a program hold (its list of targets kept stable across versions)."""
    try:
        from jax._src.export._export import _CUSTOM_CALL_TARGETS_GUARANTEED_STABLE as stable
    except ImportError:  # a jax that moved its list: the calls an lconv export can hold on any backend
        stable = {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "shape_assertion",
                  "annotate_device_placement", "tpu_custom_call", "cu_threefry2x32_ffi", "hip_threefry2x32_ffi"}
    return frozenset(stable)


def check_params_fit(params: Any, exported: jax.export.Exported, params_path: epath.Path, program: str) -> None:
    """The params are the programs' first argument: the same tree, shapes and dtypes, or one line saying what
    differs (a params.npz from another export, or edited)."""
    expected = exported.in_tree.children()[0].children()[0]
    if jax.tree.structure(params) != expected:
        raise UserError(f"{params_path} does not hold the params {program} takes (another export's, or damaged); "
                        "export the run again")
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (key, leaf), aval in zip(flat, exported.in_avals):
        if (leaf.shape, leaf.dtype) != (aval.shape, aval.dtype):
            raise UserError(f"{params_path}: {jax.tree_util.keystr(key)} is {leaf.dtype}{list(leaf.shape)} where "
                            f"{program} takes {aval.dtype}{list(aval.shape)}; export the run again")


def check_entry_fits(entry: dict[str, Any], exported: jax.export.Exported, sidecar: dict[str, Any],
                      sidecar_path: epath.Path) -> None:
    """The sidecar's rows, width and (an LM's) max_len are what the program was lowered for: an edited sidecar
    would otherwise fail at the first call with XLA's "Shape mismatch"."""
    ids = exported.in_avals[len(exported.in_avals) - (3 if sidecar["task"] == "lm" else 2)]
    out = exported.out_avals[0]
    expected = {"rows x width": (entry["rows"], entry["width"])}
    found = {"rows x width": tuple(ids.shape)}
    if sidecar["task"] == "lm":
        expected["output width (width + search.max_len)"] = entry["width"] + sidecar["search"]["max_len"]
        found["output width (width + search.max_len)"] = out.shape[1]
    for what, value in expected.items():
        if found[what] != value:
            raise UserError(f"{sidecar_path}: {entry['file']} is listed with {what} {value}, but the program takes "
                            f"{found[what]}; the sidecar was edited or is another export's: export the run again")
