"""Regenerates the bundled DDTP snapshot under lconv/data/snapshot/ from apt Translation files.

    python scripts/make_ddtp_snapshot.py --raw_dir=/path/to/ddtp-bookworm [--out_dir=lconv/data/snapshot]

raw_dir holds ``Translation-{en,de,fr,es,zh_CN}`` (.xz, .lz4 with the ``lz4`` module, or plain), e.g. Debian 12
bookworm main's files, or apt's ``/var/lib/apt/lists/*_i18n_Translation-*`` after
``apt-get -o Acquire::Languages="en,de,fr,es,zh_CN" update``. Writes one xz JSON-lines file of aligned records
per split, ``counts.json`` (parser and task counts) and ``README.md``. Output is deterministic (about a minute:
xz's extreme preset).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lconv import outputs, shared_folders  # noqa: E402
from lconv.data import ddtp  # noqa: E402
from lconv.errors import UserError  # noqa: E402

_README = """# DDTP snapshot (bundled)

Processed, aligned Debian package descriptions and their human translations, so that lconv trains and tests on
a fresh machine with no network. Everything in `lconv.data` that says "ddtp" reads these files by default.

## Source
Debian 12 "bookworm", component `main`: the apt index files `i18n/Translation-{{en,de,fr,es,zh_CN}}` (the
English descriptions and the translations made through the Debian Description Translation Project, DDTP/DDTSS).
On a Debian machine the same files come from `apt-get -o Acquire::Languages="en,de,fr,es,zh_CN" update`
(`/var/lib/apt/lists/*_i18n_Translation-*`). Newer releases give more and newer text.

## Licence (read carefully)
There is no single licence for this text. Each English description is part of its Debian package's metadata
(written by the package's maintainers or upstream) and is distributed in Debian's `main` archive, whose packages
are all free under the Debian Free Software Guidelines, under that package's own licence (see the package's
`debian/copyright`). The translations were contributed to Debian through DDTP for distribution in the archive in
the same way. We redistribute the text as Debian does, unchanged in substance (only whitespace/control-character
clean-up, see below). We are not aware of a separate licence statement for the translations; if you need
certainty for a particular use, check the packages' copyright files and the DDTP documentation. This is not
legal advice.

## Files
- `ddtp-records-{{train,validation,test}}.jsonl.xz`: one JSON object per English description:
  `{{"md5": Description-md5, "en": [synopsis, paragraph, ...], "de": [...], "fr": [...], ...}}` with every
  translation that has the same md5. The file name is the split (a stable hash of the md5,
  `lconv.data.ddtp.split_of`: {test}/1000 test, {validation}/1000 validation, the rest train), so no
  description crosses splits. Nothing is subsampled: every task is derived from these records by
  `lconv.data.ddtp.build_tasks`, the same function the raw files go through.
- `tokenizer-<task>-<key>-v<vocab>-n<sample>-t<version>.model`: the SentencePiece models that training on this
  snapshot gives for configs/default.py's data settings (`en_de`) and configs/lm1b.py:ddtp's (`lm_en`) (`<key>`:
  the snapshot's files and the builder version, `lconv.data.tfds_ddtp.source_fingerprint`). A new workdir with those
  settings copies it instead of training
  (`lconv.data.tokenizer_files.shipped_path`); `scripts/ship_tokenizer.py [config[:variant]]` makes one, and
  tests/test_shipped_tokenizer.py trains each again and compares the bytes.
- `counts.json`: the parser's counts (bad data skipped/truncated, duplicates) and the examples per task/split.

## Processing
Lines inside a paragraph are joined with one space (none between two CJK characters); verbatim lines (two
leading spaces: lists, code) are joined the same way; whitespace collapses; tabs become spaces; control
characters are removed; lines over {max_line} characters are truncated; records with invalid UTF-8 are
skipped. Several packages share one description: deduplicated by md5. Translation pairs are the synopses plus
the paragraphs one-to-one when both sides have the same number of paragraphs; pairs with an empty side or a side
over {max_segment} characters are skipped. Duplicate examples are dropped, and validation/test examples whose
source or target text occurs in an earlier split (train, then validation) are dropped. Summarization: the long
description (paragraphs joined, truncated at {max_doc} characters) -> the synopsis. LM: synopsis and long
description of every English description, one document each (same truncation). All counted in `counts.json`.

## Examples per task and split
| task | train | validation | test |
|---|---:|---:|---:|
{table}

Snapshot size: {size_mb:.1f} MB.

## Regenerate
```
python scripts/make_ddtp_snapshot.py --raw_dir=/path/to/ddtp-bookworm
```
"""


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw_dir", required=True, help="folder with Translation-{en,de,fr,es,zh_CN}[.xz]")
    parser.add_argument("--out_dir", default=ddtp.SNAPSHOT_DIR, help="where the snapshot is written")
    args = parser.parse_args(argv)
    start = time.time()
    try:  # the raw files are read, and the snapshot written, only where no other user could change them
        shared_folders.check_source_folder(args.raw_dir, "--raw_dir")
        shared_folders.raise_problem(shared_folders.make_checked(args.out_dir), "--out_dir")  # checked, then made
    except UserError as err:
        raise SystemExit(f"error: {err}") from None
    counts = collections.Counter()
    records = ddtp.align_corpus(ddtp.load_raw_corpus(args.raw_dir, counts=counts), counts)
    sizes = ddtp.write_snapshot(records, args.out_dir)
    tasks = ddtp.build_tasks(records, counts=counts)
    per_task = {task: {split: len(examples) for split, examples in splits.items()}
                for task, splits in tasks.items()}
    outputs.write_atomically(os.path.join(args.out_dir, "counts.json"),
                             json.dumps({"examples": per_task, "processing": dict(sorted(counts.items()))},
                                        indent=1) + "\n")
    table = "\n".join(f"| `{task}` | {c['train']} | {c['validation']} | {c['test']} |" for task, c in per_task.items())
    readme = _README.format(test=ddtp.TEST_PER_MILLE, validation=ddtp.VALIDATION_PER_MILLE,
                            max_line=ddtp.MAX_LINE_CHARS, max_segment=ddtp.MAX_SEGMENT_CHARS,
                            max_doc=ddtp.MAX_DOCUMENT_CHARS, table=table, size_mb=sum(sizes.values()) / 1e6)
    outputs.write_atomically(os.path.join(args.out_dir, "README.md"), readme)
    print(f"wrote {len(records)} records, {sum(sizes.values()) / 1e6:.1f} MB to {args.out_dir} "
          f"in {time.time() - start:.0f}s")
    for task, c in per_task.items():
        print(f"  {task}: {c}")


if __name__ == "__main__":
    main()
