"""Your own data (``config.data.dataset="files"``): a folder of plain-text, TSV or JSON-lines files, one per split.

Empty lines are skipped and counted; anything else malformed is one ``UserError`` line naming the file. The formats and
rules in full: docs/data.md, "Your own files".
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
from collections.abc import Iterator, Mapping

from etils import epath

from lconv import json_text
from lconv.data import paths
from lconv.errors import UserError

SPLIT_STEMS = {"train": ("train",), "validation": ("valid", "validation"), "test": ("test",)}
LM_SUFFIX, LM_KEY = "txt", "text"  # a language model's text files and JSON key, unless target_lang names them
TABLE_SUFFIXES = ("tsv", "jsonl")
_CODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
# A split's files are read whole: each is held as bytes, as text and as lines (with their objects' overhead) while
# its partner is read, so a split needs a few times its size in memory.
READ_COPIES = 4
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # what text-mode open() splits on; str.splitlines would also split on
# U+2028, U+0085 ... inside a sentence, and one such character in one file of a pair would misalign every later line


def check_code(value: str | None) -> bool:
    """A language code usable as a file suffix and a JSON key (``data.source_lang`` / ``target_lang``)."""
    return value is None or (isinstance(value, str) and bool(_CODE.match(value)) and value not in TABLE_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """Which files of ``folder`` make the dataset, and how they read (from ``config.data``)."""

    folder: str
    source_lang: str | None  # None: a language model (targets only)
    target_lang: str | None  # None: LM_SUFFIX files, LM_KEY in JSON lines
    documents: bool  # a language model's text files hold blank-line-separated documents (data.stream)
    name: str  # what logs and the data report call the dataset
    required_splits: tuple[str, ...] = ("train",)  # must be there (checked before anything is prepared)

    @property
    def input_key(self) -> str | None:
        return self.source_lang

    @property
    def target_key(self) -> str:
        return self.target_lang or LM_KEY

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k in (self.input_key, self.target_key) if k is not None)

    def identity(self) -> dict:
        """What the prepared examples depend on besides the files' contents (the copy's key)."""
        return {"source_lang": self.source_lang, "target_lang": self.target_lang,
                "documents": self.documents and self.source_lang is None}

    def text_suffixes(self) -> tuple[str, ...]:
        if self.source_lang is None:
            return (self.target_lang or LM_SUFFIX,)
        return (self.source_lang, self.target_lang)


def find_files(layout: FileLayout) -> dict[str, dict[str, str]]:
    """{split: {role: path}} of every split the folder has; a missing or ambiguous split is a UserError."""
    paths.check_url(layout.folder, "config.data.raw_dir")
    if not epath.Path(layout.folder).is_dir():
        raise UserError(f"config.data.raw_dir={layout.folder}: not a folder; name the folder of your files")
    present = {p.name for p in epath.Path(layout.folder).iterdir() if p.is_file()}
    found = {}
    for split, stems in SPLIT_STEMS.items():
        choices = {stem: _split_files(layout, stem, present) for stem in stems}
        choices = {stem: files for stem, files in choices.items() if files}
        if len(choices) > 1:
            raise UserError(f"{layout.folder} has both {' and '.join(f'{s}.*' for s in choices)} for the {split} "
                            "split; keep one")
        if choices:
            names = next(iter(choices.values()))
            found[split] = {role: paths.join(layout.folder, name) for role, name in names.items()}
    for split in layout.required_splits:
        if split not in found:
            raise UserError(_missing_split(layout, split, present))
    return found


def _split_files(layout: FileLayout, stem: str, present: set[str]) -> dict[str, str]:
    """{role: file name} of one split's format among the files ``present``; {} when it has none."""
    formats = []
    pair = [f"{stem}.{suffix}" for suffix in layout.text_suffixes()]
    there = [name for name in pair if name in present]
    if there and len(there) < len(pair):
        missing = next(name for name in pair if name not in present)
        raise UserError(f"{paths.join(layout.folder, there[0])} has no partner {missing} in {layout.folder}: a pair "
                        f"of files {' and '.join(pair)} holds one example a line")
    if there:
        formats.append({suffix: f"{stem}.{suffix}" for suffix in layout.text_suffixes()})
    formats += [{suffix: f"{stem}.{suffix}"} for suffix in TABLE_SUFFIXES if f"{stem}.{suffix}" in present]
    if len(formats) > 1:
        names = [", ".join(f.values()) for f in formats]
        raise UserError(f"{layout.folder} has {' and '.join(names)} for the same split; keep one format")
    return formats[0] if formats else {}


def _missing_split(layout: FileLayout, split: str, present: set[str]) -> str:
    stem = SPLIT_STEMS[split][0]
    pair = " + ".join(f"{stem}.{s}" for s in layout.text_suffixes())
    what = f"no {split} split (expected {pair}, {stem}.tsv or {stem}.jsonl"
    if split == "validation":
        what += ", with valid or validation as the stem"
    what += "; it has: " + (", ".join(sorted(present)[:12]) or "no files") + ")"
    if split == "train":
        hint = ("check config.data.source_lang / target_lang" if layout.source_lang is not None else
                "for a translation or summarization task set config.data.source_lang and target_lang")
    else:
        hint = (f"add one, or evaluate without {split}: --config.data.eval_splits=validation "
                "--config.decode.split=validation")
    return f"config.data.raw_dir={layout.folder} has {what}; {hint}"


def read_examples(layout: FileLayout, files: Mapping[str, str], counts: collections.Counter) -> Iterator[dict]:
    """The examples of one split ({key: text}), in file order; what is skipped is counted in ``counts``."""
    if "tsv" in files:
        examples = _tsv_examples(layout, files["tsv"], counts)
    elif "jsonl" in files:
        examples = _jsonl_examples(layout, files["jsonl"], counts)
    elif layout.source_lang is None:
        examples = _lm_examples(layout, files[layout.text_suffixes()[0]], counts)
    else:
        examples = _pair_examples(layout, files, counts)
    count = 0
    for example in examples:
        count += 1
        yield example
    if not count:
        names = " and ".join(files.values())
        raise UserError(f"{names}: no example (every line is empty, or the file is); a split needs at least one")


def check_readable(found: Mapping[str, Mapping[str, str]]) -> None:
    """Each split's files ({split: {role: path}}) plain files that fit in memory together, checked before any is read:
    one too big is a UserError naming it, not a MemoryError traceback after minutes of reading."""
    for files in found.values():
        check_fits(list(files.values()))


def check_fits(split_files: list[str]) -> None:
    """The files of one split, read whole together: plain files (``paths.check_file``) whose bytes, ``READ_COPIES``
    times over, fit in the memory available now."""
    for path in split_files:
        paths.check_file(path)
    sizes = {path: paths.size(path) for path in split_files}
    limit = paths.memory_read_limit(READ_COPIES)
    if sum(sizes.values()) <= limit:
        return
    biggest = max(sizes, key=sizes.get)
    together = f" ({sum(sizes.values()):,} with its partner)" if len(sizes) > 1 else ""
    raise UserError(f"{biggest}: {sizes[biggest]:,} bytes{together}, more than lconv can read into this machine's "
                    f"memory ({limit:,} bytes: a file is read whole, held about {READ_COPIES} times over); split the "
                    "data into smaller files, or prepare it on a machine with more memory")


def read_lines(path: str, counts: collections.Counter) -> list[str]:
    """The lines of a UTF-8 file, counted as ``records_<file name>``; not UTF-8 or too big to hold is a UserError."""
    check_fits([path])
    try:
        return _split_lines(path, counts)
    except MemoryError:  # the memory went elsewhere since it was checked
        raise UserError(f"{path}: out of memory reading it whole ({paths.size(path):,} bytes); split the data into "
                        "smaller files, or prepare it on a machine with more memory") from None


def _split_lines(path: str, counts: collections.Counter) -> list[str]:
    data = paths.read_bytes(epath.Path(path), "missing", within=os.path.dirname(path))  # no link out of raw_dir
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line} is not UTF-8 (byte 0x{data[e.start]:02x}); save the file as UTF-8, "
                        "e.g. iconv -f latin1 -t utf-8") from None
    lines = _LINE_BREAK.split(text.removeprefix("\ufeff"))
    lines = lines[:-1] if lines and not lines[-1] else lines
    counts[f"records_{paths.basename(path)}"] += len(lines)
    return lines


def _pair_examples(layout: FileLayout, files: Mapping[str, str], counts: collections.Counter) -> Iterator[dict]:
    source_path, target_path = files[layout.source_lang], files[layout.target_lang]
    sources, targets = read_lines(source_path, counts), read_lines(target_path, counts)
    if len(sources) != len(targets):
        raise UserError(f"{source_path} has {len(sources):,} lines but {target_path} {len(targets):,}: line i of one "
                        "must be paired with line i of the other")
    for source, target in zip(sources, targets):
        example = _pair(layout, source, target, counts)
        if example is not None:
            yield example


def _pair(layout: FileLayout, source: str, target: str, counts: collections.Counter) -> dict | None:
    source, target = source.strip(), target.strip()
    if not (source and target):
        counts["empty_pair" if not (source or target) else "empty_source" if not source else "empty_target"] += 1
        return None
    return {layout.source_lang: source, layout.target_lang: target}


def _lm_examples(layout: FileLayout, path: str, counts: collections.Counter) -> Iterator[dict]:
    lines = [line.strip() for line in read_lines(path, counts)]
    if not layout.documents:
        counts["empty_line"] += sum(not line for line in lines)
        yield from ({layout.target_key: line} for line in lines if line)
        return
    document = []
    for line in [*lines, ""]:
        if line:
            document.append(line)
        elif document:
            yield {layout.target_key: " ".join(document)}
            document = []


def _tsv_examples(layout: FileLayout, path: str, counts: collections.Counter) -> Iterator[dict]:
    columns = len(layout.keys)
    headers = [list(layout.keys), ["source", "target"] if columns == 2 else [LM_KEY]]
    for number, line in enumerate(read_lines(path, counts), 1):
        if not line.strip():
            counts["empty_line"] += 1
            continue
        cells = line.split("\t")
        if number == 1 and [c.strip() for c in cells] in headers:
            counts["header_line"] += 1
            continue
        if len(cells) != columns:
            layout_text = "<TAB>".join(headers[1] if columns == 2 else [layout.target_key])
            raise UserError(f"{path}: line {number} has {len(cells)} tab-separated columns, not {columns} "
                            f"({layout_text}); a text cannot hold a tab")
        example = _pair(layout, *cells, counts) if columns == 2 else _text(layout, cells[0], counts)
        if example is not None:
            yield example


def _text(layout: FileLayout, text: str, counts: collections.Counter) -> dict | None:
    if not text.strip():
        counts["empty_text"] += 1
        return None
    return {layout.target_key: text.strip()}


def _jsonl_examples(layout: FileLayout, path: str, counts: collections.Counter) -> Iterator[dict]:
    for number, line in enumerate(read_lines(path, counts), 1):
        if not line.strip():
            counts["empty_line"] += 1
            continue
        try:
            record = json_text.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: line {number} is not JSON ({e.msg}); each line holds one object") from None
        missing = [k for k in layout.keys if not isinstance(record, dict) or k not in record]
        if missing:
            raise UserError(f"{path}: line {number} has no {' or '.join(map(repr, missing))} key; each line is an "
                            f"object with {' and '.join(map(repr, layout.keys))}")
        wrong = [k for k in layout.keys if not isinstance(record[k], str)]
        if wrong:
            raise UserError(f"{path}: line {number}: {wrong[0]!r} is {type(record[wrong[0]]).__name__}, not a string")
        # JSON's \ud800 escapes decode to a lone surrogate, which no UTF-8 holds: tfds failed writing the copy.
        lone = next((k for k in layout.keys if not record[k].isascii() and _has_lone_surrogate(record[k])), None)
        if lone is not None:
            raise UserError(f"{path}: line {number}: {lone!r} holds a lone surrogate (a \\ud800-\\udfff escape "
                            "without its pair), which is no character; fix or remove that line")
        example = (_pair(layout, record[layout.source_lang], record[layout.target_lang], counts)
                   if layout.source_lang else _text(layout, record[layout.target_key], counts))
        if example is not None:
            yield example


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def copy_label(layout: FileLayout) -> str:
    """The dataset's name as a folder name (the prepared copy's and the kept tokenizer's)."""
    return "files_" + (re.sub(r"[^A-Za-z0-9_.-]+", "_", layout.name).strip("._") or "data")
