"""Several budgeted ``train.py`` runs at once on one many-core machine, each pinned to its own CPUs, each a new user.

Drawing a BLEU-vs-minutes curve, or comparing recipes, takes one 10-minute run per point: on a 2-core host they run
one after another. A machine with more cores runs them side by side, each on its own ``taskset`` CPU set, with its
own ``HOME`` (so each prepares the corpus and trains its tokenizer as a new user would) and its own workdir:

    python scripts/concurrent_runs.py --out /tmp/curves --deadline 580 \\
        --run d8,2-3,8.5 --run d4,4-5,4 --run ffn512,6-7,8.5,model.ffn_dim=512 --run gpu,0-1,8.5,@cuda

``--run NAME,CPUS,MINUTES[,FIELD=VALUE ...][,@PLATFORM]``: ``train.max_minutes=MINUTES`` and the config overrides
given (``--config.FIELD=VALUE``) on ``configs/default.py``; ``@cuda`` runs it on the accelerator (its CPUs then
serve the host side). Before the runs start, every CPU run's set measures its float32 matmul rate with all sets
measuring at once (``lconv.bench.timing.matmul_flops_per_s``): the rate each had under the shared load.

Into ``--out`` (as the runs go, so a cut session still returns them): ``machine.txt``, ``rates.json``,
``runs.tgz`` (each run's log and small workdir files: metrics.jsonl, test.scores.json, config.json), and at the end
``summary.md``: per run its CPUs, rate, first update, updates, validation loss, test BLEU and final evaluation.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lconv import outputs, shared_folders  # noqa: E402
from lconv.errors import UserError  # noqa: E402

KEPT_FILES = ("metrics.jsonl", "test.scores.json", "config.json", "data_report.json")
# The probe compiles, so it checks the compilation cache it was given as every lconv entry point does
RATE_SNIPPET = ("import json; from lconv.run import compilation_cache; compilation_cache.check_chosen(); "
                "from lconv.bench.timing import matmul_flops_per_s; print(json.dumps(matmul_flops_per_s()))")


def parse_run(text: str) -> dict:
    name, cpus, minutes, *rest = text.split(",")
    platform = next((r[1:] for r in rest if r.startswith("@")), "cpu")
    overrides = [r for r in rest if not r.startswith("@")]
    return {"name": name, "cpus": cpus, "minutes": float(minutes), "platform": platform, "overrides": overrides}


def machine_facts(out: str) -> None:
    facts = []
    # -P: the working folder is not put first on sys.path, so an lconv/ or jax/ planted there is never imported
    for command in (["lscpu"], ["nvidia-smi", "-L"], [sys.executable, "-P", "-c",
                    "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__)"]):
        try:
            facts.append(subprocess.run(command, capture_output=True, text=True, timeout=60,
                                        env=shared_folders.child_environment()).stdout)
        except (OSError, subprocess.TimeoutExpired) as error:
            facts.append(f"{command[0]}: {error}\n")
    outputs.write_atomically(os.path.join(out, "machine.txt"), "".join(facts))


def measure_rates(runs: list[dict], root: str) -> dict:
    """Each CPU run's set measures its matmul rate, all sets at once (the load the runs will share)."""
    env = shared_folders.child_environment(root, JAX_PLATFORMS="cpu")
    procs = {r["name"]: subprocess.Popen(["taskset", "-c", r["cpus"], sys.executable, "-P", "-c", RATE_SNIPPET],
                                         env=env, stdout=subprocess.PIPE, text=True)
             for r in runs if r["platform"] == "cpu"}
    rates = {}
    for name, proc in procs.items():
        text = proc.communicate(timeout=300)[0].strip().splitlines()
        rates[name] = json.loads(text[-1])["matmul_flops_per_s"] if text else None
    return rates


def launch(run: dict, root: str, scratch: str) -> subprocess.Popen:
    home = os.path.join(scratch, run["name"], "home")
    os.makedirs(home, exist_ok=True)
    env = shared_folders.child_environment(HOME=home, JAX_PLATFORMS=run["platform"], PYTHONUNBUFFERED="1")
    command = ["taskset", "-c", run["cpus"], sys.executable, os.path.join(root, "train.py"),
               f"--config={os.path.join(root, 'configs/default.py')}", f"--workdir={workdir(run, scratch)}",
               f"--config.train.max_minutes={run['minutes']}", *(f"--config.{o}" for o in run["overrides"])]
    log = open(os.path.join(scratch, run["name"] + ".log"), "w")
    log.write(" ".join(command) + "\n")
    log.flush()
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root)


def workdir(run: dict, scratch: str) -> str:
    return os.path.join(scratch, run["name"], "run")


def pack(runs: list[dict], scratch: str, out: str) -> None:
    """The logs and small workdir files into out/runs.tgz, written whole (a cut call leaves the last one)."""
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        for run in runs:
            tar.add(os.path.join(scratch, run["name"] + ".log"), arcname=f"{run['name']}/train.log")
            for name in KEPT_FILES:
                path = os.path.join(workdir(run, scratch), name)
                if os.path.exists(path):
                    tar.add(path, arcname=f"{run['name']}/{name}")
    outputs.write_atomically(os.path.join(out, "runs.tgz"), packed.getvalue())


def run_summary(run: dict, scratch: str, rate: float | None) -> dict:
    row = {"run": run["name"], "platform": run["platform"], "cpus": run["cpus"], "minutes": run["minutes"],
           "overrides": " ".join(run["overrides"]) or "-", "gflops": None if rate is None else round(rate / 1e9)}
    with open(os.path.join(scratch, run["name"] + ".log"), errors="replace") as f:
        ends = [json.loads(line) for line in f if line.startswith("{") and "first_update_seconds" in line]
    if ends:
        row.update(updates=ends[-1]["step"], first_update_s=round(ends[-1]["first_update_seconds"], 1),
                   final_eval_s=round(ends[-1].get("final_evaluation_seconds", float("nan")), 1),
                   run_s=round(ends[-1]["run_seconds"], 1))
    metrics = os.path.join(workdir(run, scratch), "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        valid = [m for m in lines if m.get("split") == "validation"]
        tests = [m for m in lines if m.get("split") == "test" and "bleu" in m]
        if valid:
            row["validation_loss"] = round(valid[-1]["loss"], 3)
        if tests:
            row.update(bleu=round(tests[-1]["bleu"], 2), sentences_per_s=round(tests[-1]["sentences_per_s"], 1))
    return row


def write_summary(rows: list[dict], out: str) -> None:
    columns = ["run", "platform", "cpus", "gflops", "minutes", "overrides", "first_update_s", "updates",
               "validation_loss", "final_eval_s", "run_s", "bleu", "sentences_per_s"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "-")) for c in columns) + " |" for row in rows]
    outputs.write_atomically(os.path.join(out, "summary.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", action="append", required=True, type=parse_run)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scratch", default=None, help="a folder to make for the runs (default: a new private "
                        "one in the system's temporary folder)")
    parser.add_argument("--deadline", type=float, default=None, help="seconds from start: runs still going are cut")
    args = parser.parse_args()
    start, root = time.monotonic(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:  # written only where no other user could swap a file for a link, or plant one
        outputs.claim_directory(args.out, "bench", "--out")
        if args.scratch is None:
            args.scratch = tempfile.mkdtemp(prefix="concurrent_runs-")
        else:
            os.makedirs(args.scratch)  # a new folder: never one emptied by name
            shared_folders.check(args.scratch, "--scratch", made_here=True)
    except FileExistsError:
        raise SystemExit(f"error: --scratch={args.scratch} exists; name a folder to make") from None
    except UserError as err:
        raise SystemExit(f"error: {err}") from None
    machine_facts(args.out)
    rates = measure_rates(args.run, root)
    outputs.write_atomically(os.path.join(args.out, "rates.json"), json.dumps(rates, indent=1))
    print("matmul rates (GFLOP/s, all sets at once):", {k: v and round(v / 1e9) for k, v in rates.items()}, flush=True)
    procs = [launch(run, root, args.scratch) for run in args.run]
    while any(p.poll() is None for p in procs):
        if args.deadline and time.monotonic() - start > args.deadline:
            for p in procs:
                p.kill()
            print(f"deadline {args.deadline:.0f} s: runs still going were cut", flush=True)
            break
        time.sleep(15)
        pack(args.run, args.scratch, args.out)
    for p in procs:
        p.wait(timeout=60)
    pack(args.run, args.scratch, args.out)
    write_summary([run_summary(r, args.scratch, rates.get(r["name"])) for r in args.run], args.out)


if __name__ == "__main__":
    main()
