"""DDTP corpus: Debian package descriptions and their human translations (apt ``Translation-*`` files), parsed, aligned
by description and split by a stable hash of it (no text crosses splits); bad data is skipped and counted, never raised.
The bundled snapshot stores the aligned records. The text conventions: docs/data.md."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import lzma
import os
import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from etils import epath

from lconv import outputs
from lconv.data import paths
from lconv.errors import UserError

LANGS = ("en", "de", "fr", "es", "zh_CN")
# task name -> the non-English language of the pair. Both directions are usable (``sources.py``).
TRANSLATION_TASKS = {"en_de": "de", "en_fr": "fr", "en_es": "es", "en_zh": "zh_CN"}
TASKS = (*TRANSLATION_TASKS, "summarize_en", "lm_en")
SPLITS = ("train", "validation", "test")
# Per-mille buckets of the split hash: [0, TEST) test, then validation, then train; the counts: docs/data.md.
TEST_PER_MILLE = 45
VALIDATION_PER_MILLE = 45
MAX_LINE_CHARS = 2000  # a raw line longer than this is truncated (real lines are < 1200 chars)
MAX_SEGMENT_CHARS = 1500  # a translation pair with a longer side is skipped; < MAX_LINE_CHARS, so a
# truncated line never yields a (mis-aligned) pair
MAX_DOCUMENT_CHARS = 8000  # summarization inputs / LM documents are truncated to this (at a space)

_MD5_RE = re.compile(r"^[0-9a-f]{32}$")
_FIELD_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_-]*):\s?(.*)$")
_WS_RE = re.compile(r"\s+")
# C0/C1 controls, surrogates and invisible format characters; zero-width (non-)joiners stay (some scripts need them).
_CONTROL_RE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u200b\u200e\u200f\u202a-\u202e"
                         "\u2060-\u2064\ufeff]")


@dataclasses.dataclass(frozen=True)
class Description:
    """One cleaned package description in one language."""

    md5: str  # Description-md5: the md5 of the English description, the alignment key
    synopsis: str  # the one-line short description
    paragraphs: tuple[str, ...]  # the long description, one cleaned string per paragraph


# I/O: the only functions that touch files.


INDEX_COPIES = 8  # an index's text is held about this many times over while it is parsed into descriptions
INDEX_MAX_BYTES = 1 << 30  # an apt Translation file is tens of MB: a GiB is far above any real one


def _inflate(decompressor: Any, data: bytes, limit: int, path: str | os.PathLike) -> bytes:
    """``data`` decompressed, at most ``limit`` bytes of it (a small file of zeros inflates to all memory)."""
    text = decompressor.decompress(data, max_length=limit + 1)
    if len(text) > limit:
        raise UserError(f"{path} decompresses to more than {limit:,} bytes, more than this host can parse (an apt "
                        "Translation file is tens of MB); is it one?")
    if not decompressor.eof:
        raise EOFError("the compressed data ends early")
    return text


def read_index_bytes(path: str | os.PathLike) -> bytes:
    """Bytes of an apt Translation index (xz, lz4 if installed, or plain); a damaged file is a UserError."""
    # local or a URL (raw_dir=gs://...), read as opened and inside its folder (a link swapped in is refused)
    limit = min(paths.memory_read_limit(INDEX_COPIES), INDEX_MAX_BYTES)
    data = paths.read_bytes(epath.Path(path), "missing", within=os.path.dirname(os.fspath(path)), limit=limit)
    name = paths.basename(path)
    if data.startswith(b"\xfd7zXZ\x00"):
        try:
            return _inflate(lzma.LZMADecompressor(), data, limit, path)
        except (lzma.LZMAError, EOFError) as e:
            raise UserError(f"{path} is a damaged or truncated xz file ({e}); download {name} again") from e
    if data.startswith(b"\x04\x22\x4d\x18"):  # lz4 frame magic (apt's lists/*_Translation-*.lz4)
        try:
            import lz4.frame  # optional dependency
        except ImportError as e:
            raise UserError(f"{path} is lz4-compressed; pip install lz4 or pass the .xz/plain file") from e
        try:
            return _inflate(lz4.frame.LZ4FrameDecompressor(), data, limit, path)
        except (RuntimeError, EOFError) as e:
            raise UserError(f"{path} is a damaged or truncated lz4 file ({e}); download {name} again") from e
    for suffix in (".xz", ".lz4"):
        if name.endswith(suffix):
            raise UserError(f"{path} is named {suffix} but is not {suffix[1:]} data ({len(data)} bytes); "
                            f"download {name} again")
    return data


def find_index_file(raw_dir: str | os.PathLike, lang: str) -> str | None:
    """Path of ``Translation-<lang>`` in raw_dir (.xz, .lz4, plain, or apt's ``*_i18n_Translation-<lang>``)."""
    names = sorted(child.name for child in epath.Path(raw_dir).iterdir())
    for suffix in (".xz", ".lz4", ""):
        for name in names:
            if name == f"Translation-{lang}{suffix}" or name.endswith(f"_i18n_Translation-{lang}{suffix}"):
                return paths.join(raw_dir, name)
    return None


def task_langs(task: str) -> tuple[str, ...]:
    """The languages whose Translation files a task is built from."""
    if task in TRANSLATION_TASKS:
        return ("en", TRANSLATION_TASKS[task])
    if task in TASKS:
        return ("en",)
    raise UserError(f"task={task!r} is unknown; use one of {TASKS}")


def find_task_files(raw_dir: str | os.PathLike, tasks: Iterable[str]) -> dict[str, str]:
    """{lang: path} of the Translation files ``tasks`` need; a missing one is a UserError naming them all."""
    paths.check_url(raw_dir, "raw_dir")
    if not epath.Path(raw_dir).is_dir():
        raise UserError(f"raw_dir={str(raw_dir)!r} is not a directory; point it at the apt Translation-* files")
    tasks = tuple(tasks)
    langs = sorted({lang for task in tasks for lang in task_langs(task)}, key=LANGS.index)
    files = {lang: find_index_file(raw_dir, lang) for lang in langs}
    missing = [f"Translation-{lang}" for lang, path in files.items() if path is None]
    if missing:
        raise UserError(f"raw_dir={str(raw_dir)!r} has no {', '.join(missing)} (.xz, .lz4 or plain), which "
                        f"{', '.join(tasks)} needs; add it, or unset raw_dir to use the bundled snapshot")
    return files


def load_raw_corpus(raw_dir: str | os.PathLike, langs: Iterable[str] = LANGS,
                    counts: collections.Counter | None = None) -> dict[str, dict[str, Description]]:
    """Parses every ``Translation-<lang>`` file in raw_dir; English is required, missing others are counted."""
    counts = collections.Counter() if counts is None else counts
    corpus = {}
    for lang in langs:
        path = find_index_file(raw_dir, lang)
        if path is None:
            if lang == "en":
                raise UserError(f"raw_dir={raw_dir!r} has no Translation-en[.xz|.lz4]; point raw_dir at the apt files")
            counts[f"missing_file_{lang}"] += 1
            continue
        corpus[lang] = parse_index(read_index_bytes(path), lang, counts)
        if not corpus[lang]:
            raise UserError(f"{path} holds no usable package description (no record with Description-md5 and "
                            f"Description-{lang}); is it an apt Translation-{lang} file?")
    return corpus


# Pure functions.


def split_of(md5: str) -> str:
    """Stable split of a description: a salted sha1 of its Description-md5, bucketed per mille."""
    bucket = int(hashlib.sha1(f"lconv-ddtp-split:{md5}".encode()).hexdigest()[:8], 16) % 1000
    if bucket < TEST_PER_MILLE:
        return "test"
    if bucket < TEST_PER_MILLE + VALIDATION_PER_MILLE:
        return "validation"
    return "train"


def clean_line(line: str, counts: collections.Counter) -> str:
    """Tabs -> spaces, other control characters removed, absurdly long lines truncated; each counted."""
    if "\t" in line:
        counts["tab_replaced"] += 1
        line = line.replace("\t", " ")
    if _CONTROL_RE.search(line):
        counts["control_chars_removed"] += 1
        line = _CONTROL_RE.sub("", line)
    if len(line) > MAX_LINE_CHARS:
        counts["line_truncated"] += 1
        line = line[:MAX_LINE_CHARS]
    return line


def _is_cjk(ch: str) -> bool:
    return unicodedata.east_asian_width(ch) in ("W", "F")


def join_lines(lines: Iterable[str]) -> str:
    """Joins wrapped lines of one paragraph: one space, none between two CJK characters; whitespace collapsed."""
    out = ""
    for line in lines:
        line = _WS_RE.sub(" ", line).strip()
        if not line:
            continue
        if out and not (_is_cjk(out[-1]) and _is_cjk(line[0])):
            out += " "
        out += line
    return out


def parse_record(text: str, lang: str, counts: collections.Counter) -> Description | None:
    """One blank-line-separated record -> Description, or None (counted) when it is unusable."""
    md5, synopsis, body, in_description = None, None, [], False
    for raw_line in text.split("\n"):
        if not raw_line.strip():
            if raw_line:
                counts["whitespace_line_skipped"] += 1
            continue
        if raw_line.startswith(" "):
            if not in_description:
                counts["stray_continuation_line"] += 1
                continue
            body.append(raw_line[1:])  # Debian: one leading space; "  " = verbatim, "." = paragraph break
            continue
        match = _FIELD_RE.match(raw_line)
        if match is None:
            counts["malformed_line"] += 1
            in_description = False
            continue
        field, value = match.groups()
        in_description = False
        if field == "Description-md5":
            md5 = value.strip().lower()
        elif field == f"Description-{lang}":
            synopsis, in_description = value, True
    if md5 is None or not _MD5_RE.match(md5):
        counts["record_without_md5"] += 1
        return None
    if synopsis is None:
        counts["record_without_description"] += 1
        return None
    paragraphs, current = [], []
    for line in body:
        if line.strip() == ".":
            paragraphs.append(current)
            current = []
        else:
            current.append(clean_line(line, counts))
    paragraphs.append(current)
    joined = []
    for lines in paragraphs:
        paragraph = join_lines(lines)
        if paragraph:
            joined.append(paragraph)
        elif lines:  # a paragraph of only whitespace/control characters
            counts["empty_paragraph_skipped"] += 1
    return Description(md5, join_lines([clean_line(synopsis, counts)]), tuple(joined))


def parse_index(data: bytes, lang: str, counts: collections.Counter) -> dict[str, Description]:
    """A whole Translation-<lang> file's bytes -> {md5: Description}; first record per md5 wins (counted)."""
    out: dict[str, Description] = {}
    data = data.replace(b"\r\n", b"\n")
    for raw in re.split(rb"\n[ \t]*\n", data):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            counts[f"invalid_utf8_record_{lang}"] += 1
            continue
        desc = parse_record(text, lang, counts)
        if desc is None:
            continue
        counts[f"records_{lang}"] += 1
        previous = out.get(desc.md5)
        if previous is None:
            out[desc.md5] = desc
        elif previous == desc:
            counts[f"duplicate_md5_{lang}"] += 1  # several packages share one description
        else:
            counts[f"conflicting_duplicate_md5_{lang}"] += 1
    counts[f"unique_descriptions_{lang}"] = len(out)
    return out


def align_corpus(corpus: Mapping[str, Mapping[str, Description]],
                 counts: collections.Counter) -> list[dict]:
    """One JSON-able record per English description, sorted by md5, with every translation of that md5."""
    english = corpus["en"]
    for lang, descs in corpus.items():
        if lang != "en":
            counts[f"no_english_source_{lang}"] += sum(md5 not in english for md5 in descs)
    records = []
    for md5 in sorted(english):
        record = {"md5": md5, "split": split_of(md5)}
        for lang in corpus:
            desc = corpus[lang].get(md5)
            if desc is not None:
                record[lang] = [desc.synopsis, *desc.paragraphs]
        records.append(record)
    return records


def _truncate(text: str, limit: int, counts: collections.Counter, key: str) -> str:
    if len(text) <= limit:
        return text
    counts[key] += 1
    cut = text.rfind(" ", 0, limit)
    return text[: cut if cut > limit // 2 else limit]


def translation_pairs(record: Mapping, lang: str, counts: collections.Counter) -> list[tuple[str, str]]:
    """(english, translation) segment pairs of one aligned record: synopses, then paragraphs if counts match."""
    en, xx = record.get("en"), record.get(lang)
    if not en or not xx:
        return []
    pairs = [(en[0], xx[0])]
    if len(en) == len(xx):
        pairs += list(zip(en[1:], xx[1:]))
    else:
        counts[f"paragraph_count_mismatch_{lang}"] += 1
    kept = []
    for src, tgt in pairs:
        if not src or not tgt:
            counts[f"empty_side_{lang}"] += 1
        elif len(src) > MAX_SEGMENT_CHARS or len(tgt) > MAX_SEGMENT_CHARS:
            counts[f"pair_too_long_{lang}"] += 1
        else:
            kept.append((src, tgt))
    return kept


def _task_examples(record: Mapping, task: str, counts: collections.Counter) -> list[dict]:
    if task in TRANSLATION_TASKS:
        lang = TRANSLATION_TASKS[task]
        key = task.split("_")[1]  # "zh" for zh_CN
        return [{"en": s, key: t} for s, t in translation_pairs(record, lang, counts)]
    en = record.get("en") or []
    if not en or not en[0]:
        counts[f"{task}_empty_english"] += 1
        return []
    document = " ".join(en[1:])
    if task == "summarize_en":
        if not document:
            counts["summarize_en_no_long_description"] += 1
            return []
        return [{"document": _truncate(document, MAX_DOCUMENT_CHARS, counts, "summarize_en_truncated"),
                 "summary": en[0]}]
    if task == "lm_en":
        text = " ".join(en)
        return [{"text": _truncate(text, MAX_DOCUMENT_CHARS, counts, "lm_en_truncated")}]
    raise UserError(f"task={task!r} is unknown; use one of {TASKS}")


def build_tasks(records: Iterable[Mapping], tasks: Iterable[str] = TASKS,
                counts: collections.Counter | None = None,
                counts_by_split: Mapping[str, collections.Counter] | None = None,
                ) -> dict[str, dict[str, list[dict]]]:
    """Aligned records -> {task: {split: [example, ...]}}, de-duplicated, no text shared across splits."""
    counts = collections.Counter() if counts is None else counts
    records = list(records)
    out = {}
    for task in tasks:
        by_split = {split: [] for split in SPLITS}
        seen_texts: set[str] = set()  # every text field of the earlier splits' examples
        for split in SPLITS:  # train first: evaluation examples overlapping train are the ones dropped
            seen_examples, split_texts, split_counts = set(), set(), collections.Counter()
            for record in records:
                if record["split"] != split:
                    continue
                for example in _task_examples(record, task, split_counts):
                    fields = tuple(example.values())
                    if fields in seen_examples:
                        split_counts[f"{task}_duplicate"] += 1
                        continue
                    seen_examples.add(fields)
                    if split != "train" and any(text in seen_texts for text in fields):
                        split_counts[f"{task}_{split}_overlap"] += 1
                        continue
                    split_texts.update(fields)
                    by_split[split].append({**example, "md5": record["md5"]})
            seen_texts |= split_texts
            counts.update(split_counts)
            if counts_by_split is not None:
                counts_by_split[split].update(split_counts)
        out[task] = by_split
        for split in SPLITS:
            counts[f"{task}_{split}_examples"] = len(by_split[split])
    return out


# The bundled snapshot: aligned records, one xz-compressed JSON-lines file per split.

SNAPSHOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snapshot")


def snapshot_file(snapshot_dir: str | os.PathLike, split: str) -> str:
    return os.path.join(snapshot_dir, f"ddtp-records-{split}.jsonl.xz")


def write_snapshot(records: Iterable[Mapping], snapshot_dir: str | os.PathLike) -> dict[str, int]:
    """Writes the aligned records (``align_corpus``) per split; returns {path: bytes written}. Deterministic."""
    os.makedirs(snapshot_dir, exist_ok=True)
    lines = {split: [] for split in SPLITS}
    for record in records:
        fields = {k: v for k, v in record.items() if k != "split"}  # the file names the split
        lines[record["split"]].append(json.dumps(fields, ensure_ascii=False, separators=(",", ":")))
    sizes = {}
    for split in SPLITS:
        data = ("\n".join(lines[split]) + "\n").encode("utf-8")
        path = snapshot_file(snapshot_dir, split)
        outputs.write_atomically(path, lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))  # never via a link
        sizes[path] = os.path.getsize(path)
    return sizes


def load_snapshot_records(snapshot_dir: str | os.PathLike | None = None) -> list[dict]:
    """The aligned records of the bundled (or a given) snapshot, with their ``"split"`` restored."""
    snapshot_dir = SNAPSHOT_DIR if snapshot_dir is None else snapshot_dir
    records = []
    for split in SPLITS:
        path = snapshot_file(snapshot_dir, split)
        if not os.path.exists(path):
            raise UserError(f"snapshot file {path} is missing; regenerate it with scripts/make_ddtp_snapshot.py")
        try:
            with lzma.open(path, "rt", encoding="utf-8") as f:
                records += [{**json.loads(line), "split": split} for line in f if line.strip()]
        except (lzma.LZMAError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"snapshot file {path} is damaged ({e}); reinstall lconv or regenerate it with "
                            "scripts/make_ddtp_snapshot.py") from e
    return records


def load_tasks(raw_dir: str | os.PathLike | None = None, tasks: Iterable[str] = TASKS,
               counts: collections.Counter | None = None,
               counts_by_split: Mapping[str, collections.Counter] | None = None,
               ) -> dict[str, dict[str, list[dict]]]:
    """{task: {split: examples}} from raw Translation files in raw_dir, or the bundled snapshot if None."""
    counts = collections.Counter() if counts is None else counts
    tasks = tuple(tasks)
    if raw_dir is None:
        records = load_snapshot_records()
    else:
        langs = find_task_files(raw_dir, tasks)
        records = align_corpus(load_raw_corpus(raw_dir, langs=langs, counts=counts), counts)
    return build_tasks(records, tasks, counts, counts_by_split)

