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

Writes hypotheses and a JSON of scores (sacreBLEU, ROUGE-1/2/L, or an LM's perplexity); ``--nbest=k`` writes
fairseq-generate's ``H-<i>`` / ``P-<i>`` lines. Bad flags and unreadable inputs are one line (exit code 2) before
anything loads. Details: docs/training.md, "Evaluation".
"""
from lconv.cli import programs

if __name__ == "__main__":
    programs.evaluate()
