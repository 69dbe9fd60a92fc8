"""Evaluates a trained run with the config stored in its workdir (from an install: ``python -m lconv.evaluate``).

    python eval.py --workdir=runs/default [--split=test] [--average_last=5 | --checkpoint=best]
                   [--beam_size=5 --lenpen=1.0]
    python eval.py --workdir=runs/default --source_file=F [--reference_file=R] --output_file=O
    python eval.py --workdir=runs/lm --source_file=prompts.txt [--max_len=50 --temperature=0.8 --top_p=0.9]
    python eval.py --workdir=runs/default --interactive          # stdin -> stdout, a line at a time

Writes hypotheses and a JSON of scores (sacreBLEU with its signature, ROUGE-1/2/L, or an LM's perplexity); for
an LM run, ``--source_file`` holds prompts and the output file their continuations. Bad flags (and flag
combinations), unreadable or non-UTF-8 input files and unwritable outputs are reported in one line (exit code 2)
before anything is loaded. A blank --source_file line gets an empty output line; blank and over-long lines are
counted in the log and in the scores.
"""
from lconv.cli import programs

if __name__ == "__main__":
    programs.evaluate()
