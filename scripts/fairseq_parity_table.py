"""The fairseq parity matrix as a table: each case of tests/fixtures/fairseq_parity imported and compared with
fairseq's recorded outputs (``tests/fairseq_parity.py``, the comparisons tests/test_fairseq_parity.py asserts).

    PYTHONPATH=. python scripts/fairseq_parity_table.py                         # print the markdown table
    PYTHONPATH=. python scripts/fairseq_parity_table.py --write docs/fairseq.md  # refresh the table in the docs

``--write`` replaces what stands between ``<!-- fairseq-parity:begin -->`` and ``<!-- fairseq-parity:end -->``
and writes every number to docs/results/fairseq_parity.json. Imports and compiles each case: about 20 s a case
on one CPU core (some 15 minutes for the matrix).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import fairseq_parity as parity  # noqa: E402
import markdown_block  # noqa: E402

BEGIN, END = "<!-- fairseq-parity:begin -->", "<!-- fairseq-parity:end -->"
RESULTS = os.path.join(ROOT, "docs", "results", "fairseq_parity.json")


def compare(name: str, workdir: str) -> dict:
    """One case's results: ``refused`` (the importer's line) or the worst differences of each comparison."""
    import lconv

    try:
        parity.import_workdir(name, workdir)
    except Exception as err:  # noqa: BLE001 - a crash (not a UserError) is a result too: the table names it
        return {"imported": False, "refused": _message(err, workdir)}
    try:
        model = lconv.load(workdir)
    except Exception as err:  # noqa: BLE001 - as above
        return {"imported": False, "refused": "the import's workdir does not load: " + _message(err, workdir)}
    result: dict = {"imported": True, "lprobs": parity.lprobs_difference(model, name)}
    if parity.case(name)["task"] == "translation":
        for beams in (1, 4):
            found = parity.search_differences(model, name, beams)
            total = len(parity.outputs(name)["src_lengths"]) * beams
            key = "greedy" if beams == 1 else f"beam{beams}"
            result[key] = {"identical": total - len(found["differing"]), "of": total, "score": found["score"]}
    else:
        result["perplexity"] = parity.perplexity_difference(model, name)
        ours, theirs = parity.greedy_continuations(model, name)
        result["greedy"] = {"identical": sum(a == b for a, b in zip(ours, theirs)), "of": len(theirs)}
    return result


def _message(err: Exception, workdir: str) -> str:
    from lconv.errors import UserError

    text = str(err) if isinstance(err, UserError) else f"{type(err).__name__}: {err}"
    return text.replace(workdir, "<workdir>").replace(str(parity.FIXTURES) + os.sep, "")


def _cell(result: dict, key: str) -> str:
    if not result["imported"]:
        return ""
    if key == "lprobs":
        return f"{result['lprobs']:.1e}" + ("" if parity.within_float32(result["lprobs"]) else " ✗")
    if key == "perplexity":
        return f"{100 * result['perplexity']['relative']:.4f}%"
    found = result[key]
    return f"{found['identical']}/{found['of']}"


def table(results: dict) -> str:
    lines = ["| case | covers | import | worst log-prob difference (relative below -1) | greedy | beam 4 | "
             "eval-lm ppl difference |",
             "|---|---|---|---|---|---|---|"]
    for name, entry in parity.manifest()["cases"].items():
        result = results[name]
        status = "imported" if result["imported"] else "refused: " + result["refused"].replace("|", "/")[:160]
        translation = entry["task"] == "translation"
        lines.append(f"| `{name}` | {entry['covers']} | {status} | {_cell(result, 'lprobs')} | "
                     f"{_cell(result, 'greedy')} | {_cell(result, 'beam4') if translation else ''} | "
                     f"{'' if translation else _cell(result, 'perplexity')} |")
    imported = sum(r["imported"] for r in results.values())
    lines.append(f"\n{imported} of {len(results)} cases imported.")
    return "\n".join(lines)


def generate() -> str:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in parity.manifest()["cases"]:
            results[name] = compare(name, os.path.join(scratch, name))
            print(f"{name}: {json.dumps(results[name])[:200]}", file=sys.stderr, flush=True)
    if "--write" in sys.argv:
        with open(RESULTS, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
            f.write("\n")
    return table(results)


if __name__ == "__main__":
    markdown_block.main(__doc__.split("\n")[0], generate, BEGIN, END)
