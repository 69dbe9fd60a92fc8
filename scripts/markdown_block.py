"""The generated tables' command line: print a block of markdown, or write it between two marker comments of a
docs file (``--write FILE``), keeping the hand-written text around it."""
import argparse
from collections.abc import Callable


def main(description: str, generate: Callable[[], str], begin: str, end: str) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--write", metavar="MARKDOWN", help="replace the block between the markers in this file")
    args = parser.parse_args()
    block = generate()
    if not args.write:
        print(block)
        return
    with open(args.write) as f:
        text = f.read()
    if begin not in text or end not in text:
        raise SystemExit(f"{args.write} has no {begin} ... {end} block to replace")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    with open(args.write, "w") as f:
        f.write(f"{head}{begin}\n{block}\n{end}{tail}")
