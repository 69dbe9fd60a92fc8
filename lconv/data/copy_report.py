"""A prepared copy's ``lconv_report.json``: its source and what was skipped or altered, grouped for people to read
(from ``lconv.data.ddtp``'s counts), and read back checked field by field. The layout: docs/data.md."""
from __future__ import annotations

import collections
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from etils import epath

from lconv import json_text
from lconv.data import ddtp, paths
from lconv.errors import UserError

if TYPE_CHECKING:
    import tensorflow_datasets as tfds

REPORT_FILENAME = "lconv_report.json"  # in a prepared version directory: its source and skip counts


def read_report(builder: tfds.core.DatasetBuilder) -> dict:
    """The ``lconv_report.json`` of a copy ``prepare`` returned: source, examples, skipped and altered counts."""
    path = epath.Path(builder.data_dir) / REPORT_FILENAME
    data = paths.read_bytes(path, "missing from the prepared copy (remove the copy to prepare it again)")
    try:
        report = json_text.loads(data)
    except ValueError as err:
        raise UserError(f"{path}: not the report lconv wrote ({err}); remove the copy to prepare it again") from None
    if not isinstance(report, dict):
        raise UserError(f"{path}: not the report lconv wrote (not an object); remove the copy to prepare it again")
    for field, valid in _REPORT_FIELDS.items():
        if not valid(report.get(field)):
            raise UserError(f"{path}: not the report lconv wrote ({field!r} is {report.get(field)!r:.60}); remove the "
                            "copy to prepare it again")
    return report


def _counts_by(depth: int) -> Callable[[Any], bool]:
    """Whether a value is ``{name: count}`` nested ``depth`` objects deep (what the report's counts are)."""
    def valid(value: Any) -> bool:
        if depth == 0:
            return isinstance(value, int) and not isinstance(value, bool)
        inner = _counts_by(depth - 1)
        return isinstance(value, dict) and all(isinstance(k, str) and inner(v) for k, v in value.items())
    return valid


_REPORT_FIELDS: dict[str, Callable[[Any], bool]] = {  # what lconv reads back from a report
    "dataset": lambda value: isinstance(value, str), "source": lambda value: isinstance(value, str),
    "examples": _counts_by(1), "records": _counts_by(1), "skipped": _counts_by(2), "altered": _counts_by(2)}


_TOTALS_RE = re.compile(r"^(records_|unique_descriptions_|missing_file_)|_examples$")
_ALTERED_RE = re.compile(r"^(tab_replaced|control_chars_removed|line_truncated)$|_truncated$")


def counts_report(counts: Mapping[str, int], counts_by_split: Mapping[str, Mapping[str, int]]) -> dict:
    """{"skipped": ..., "altered": ..., "records": {lang: n}}: the non-zero counts by stage and reason."""
    split_totals = collections.Counter()
    for split_counts in counts_by_split.values():
        split_totals.update(split_counts)
    stages = {"parse": {k: n - split_totals[k] for k, n in counts.items()}, **counts_by_split}
    report = {"skipped": {}, "altered": {}}
    for stage, stage_counts in stages.items():
        for reason, n in sorted(stage_counts.items()):
            if n and not _TOTALS_RE.search(reason):
                kind = "altered" if _ALTERED_RE.search(reason) else "skipped"
                report[kind].setdefault(stage, {})[reason] = int(n)
    report["records"] = records(counts)
    return report


def records(counts: Mapping[str, int]) -> dict[str, int]:
    """{lang: records parsed} from ddtp's counts."""
    return {k.removeprefix("records_"): int(n) for k, n in sorted(counts.items()) if k.startswith("records_")}


_PARSE_COUNT_RE = re.compile(
    r"^(?:records|unique_descriptions|invalid_utf8_record|conflicting_duplicate_md5|duplicate_md5|no_english_source)"
    r"_(?P<lang>.+)$|^(?:record_without_md5|record_without_description|whitespace_line_skipped|"
    r"stray_continuation_line|malformed_line|empty_paragraph_skipped|tab_replaced|control_chars_removed|"
    r"line_truncated)$")


def snapshot_parse_counts(langs: tuple[str, ...]) -> collections.Counter:
    """The parse counts recorded when the bundled snapshot was made, for ``langs``."""
    with open(os.path.join(ddtp.SNAPSHOT_DIR, "counts.json"), encoding="utf-8") as f:
        recorded = json.load(f)["processing"]
    parse = collections.Counter()
    for reason, n in recorded.items():
        match = _PARSE_COUNT_RE.match(reason)
        if match and match["lang"] in (None, *langs):
            parse[reason] = n
    return parse
