"""Evaluates a trained run with the config stored in its workdir: ``python -m lconv.evaluate`` from an installed
package, ``python eval.py`` from a clone (the same program and flags).

    python -m lconv.evaluate --workdir=runs/default [--split=test] [--average_last=5 | --checkpoint=best]
                             [--beam_size=5 --lenpen=1.0]
    python -m lconv.evaluate --workdir=runs/default --source_file=F [--reference_file=R] --output_file=O
    python -m lconv.evaluate --workdir=runs/default --source_file=F --output_file=O --nbest=5 [--beam_size=5]
    python -m lconv.evaluate --workdir=runs/default --source_file=F --output_file=O --temperature=0.8 [--top_k=
                             --top_p= --seed= --nbest=k]                  # sampled translations
    python -m lconv.evaluate --workdir=runs/lm --source_file=prompts.txt [--max_len=50 --temperature=0.8 --top_p=0.9]
    python -m lconv.evaluate --workdir=runs/default --interactive          # stdin -> stdout, a line at a time
    python -m lconv.evaluate --workdir=runs/cnn --no_repeat_ngram_size=3 --min_len=10   # generation guards
    python -m lconv.evaluate --workdir=runs/a --ensemble=runs/b,runs/c   # an ensemble -> runs/a/test.ensemble.*

Writes hypotheses and a JSON of scores (sacreBLEU with its signature, ROUGE-1/2/L, or an LM's perplexity); for
an LM run, ``--source_file`` holds prompts and the output file their continuations. With ``--nbest=k`` each source
gets k hypotheses (k <= the beam size; or k samples), written as fairseq-generate writes them, best first: a line
``H-<i>``, score, text and a line ``P-<i>``, the token log-probabilities (tab-separated; ``i`` the 0-based line; see
docs/training.md). ``--workdir`` may be a URL
(``gs://...``) or read-only: only a split's outputs are written into it (the compilation cache is this user's).
Bad flags (and flag combinations), unreadable or non-UTF-8 input files and unwritable outputs are reported in one
line (exit code 2) before anything is loaded. A blank --source_file line gets an empty output line; a line longer
than config.data.eval_max_input_length tokens is cut to it with a warning naming it; both are counted in the
scores.
"""
from lconv.cli import programs

if __name__ == "__main__":
    programs.evaluate()
