"""lconv's training step against fairseq 0.12.2's on the same model and batch: tokens/s, their ratio, first update.

    python scripts/vs_fairseq.py --fairseq_python=/path/to/venv-with-fairseq/bin/python --mode=pinned --minutes=2
    python scripts/vs_fairseq.py --fairseq_python=... --mode=all --minutes=2
    python scripts/vs_fairseq.py --fairseq_python=... --profile      # and where each step's time goes, by op class

The model is configs/default.py's (DynamicConv, d 256, 3+3 layers, kernels 3/7/15, pre-norm, GLU, shared
embeddings, vocabulary 4,000, no dropout); fairseq builds it as its own ``lightconv`` architecture from arguments
mapped from lconv's config, and the mapping is checked by reading those arguments back through lconv's fairseq
importer (``lconv.interop.fairseq.model_fields``). Both sides train with Adam and label-smoothed cross-entropy
(fairseq through its ``Trainer.train_step``, as ``fairseq-train`` does each update; lconv through the train step
train.py compiles, its state donated), on the same random sentence pairs of ``--length`` tokens (EOS included),
``--tokens`` target tokens per update: fairseq as one ``[sentences, length]`` batch, lconv packed into the default's
``[32, 64]`` rows as its pipeline packs them.

Each system runs in a process of its own (fairseq's in ``--fairseq_python``, a venv with torch and fairseq; see
docs/benchmarks.md), started one after the other so they do not compete while starting; "first update" is from a
process's launch to its first update's end (imports, building, lconv's compilation). Then windows of
``--window_steps`` updates alternate A B A B until ``--minutes`` are spent; tokens/s is the median over a system's
windows. ``--mode=pinned``: both on one core (``taskset -c --core``), one thread each (XLA's Eigen pool off, torch
and OpenMP at 1); ``--mode=all``: every core, each library's own threading. It reports and never asserts. Without
fairseq (no ``--fairseq_python``, or fairseq not importable there) it says so in one line and times lconv alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("lconv", "fairseq")
ROW_LENGTH_KEY = "max_target_length"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What is measured, and how."""

    mode: str = "pinned"  # pinned | all
    minutes: float = 2.0  # of alternating windows, after both systems' first updates
    window_steps: int = 10
    tokens: int = 1950  # target tokens per update (EOS included), rounded down to whole sentences
    length: int = 16  # tokens per sentence, source and target (EOS included)
    core: int = 0  # the core both systems are pinned to in pinned mode
    seed: int = 1
    fairseq_python: str = ""
    profile: bool = False
    profile_steps: int = 5
    lconv_xla_flags: str = ""  # added to XLA_FLAGS of the lconv worker (an A/B of XLA:CPU options)

    @property
    def sentences(self) -> int:
        return self.tokens // self.length


# ----------------------------------------------------------------------------------------------------------------
# The model: lconv's default config, and the fairseq arguments that build the same model
# ----------------------------------------------------------------------------------------------------------------
def lconv_config(settings: Settings):
    sys.path.insert(0, ROOT)
    from lconv.configs import default

    config = default.get_config()
    config.seed = settings.seed
    config.mesh.shape = (1, 1, 1)
    return config


def fairseq_args(config) -> dict[str, Any]:
    """fairseq ``lightconv`` arguments (as ``argparse`` names) of lconv's ``config.model`` and ``config.optim``."""
    m, o = config.model, config.optim
    conv_type = {"dynamicconv": "dynamic", "lightconv": "lightweight"}
    args = dict(arch="lightconv", share_all_embeddings=bool(m.share_embeddings),
                encoder_layers=m.encoder_layers, decoder_layers=m.decoder_layers,
                max_source_positions=m.max_len, max_target_positions=m.max_len,
                dropout=m.dropout, attention_dropout=m.attention_dropout, relu_dropout=m.relu_dropout,
                input_dropout=m.input_dropout, weight_dropout=m.weight_dropout, weight_softmax=bool(m.weight_softmax))
    for side in ("encoder", "decoder"):
        args.update({f"{side}_embed_dim": m.d_model, f"{side}_ffn_embed_dim": m.ffn_dim,
                     f"{side}_attention_heads": m.num_heads, f"{side}_normalize_before": bool(m.normalize_before),
                     f"{side}_glu": bool(m.use_glu), f"{side}_conv_dim": m.d_model,
                     f"{side}_conv_type": conv_type[m[f"{side}_mixer"]],
                     f"{side}_kernel_size_list": list(m[f"{side}_kernel_sizes"]), f"{side}_learned_pos": False})
    args.update(optimizer="adam", adam_betas=f"({o.b1},{o.b2})", adam_eps=o.eps, lr=[o.learning_rate],
                lr_scheduler="inverse_sqrt", warmup_updates=o.warmup_steps, warmup_init_lr=o.warmup_init_lr,
                criterion="label_smoothed_cross_entropy", label_smoothing=o.label_smoothing, clip_norm=o.clip_norm)
    return args


def check_mapping(args: dict[str, Any], config) -> list[str]:
    """The fields where lconv's fairseq importer, reading ``args``, would build another model than ``config``'s."""
    from lconv.interop import fairseq as interop

    fields = interop.model_fields(args, config.data.vocab_size)
    m = config.model
    want = dict(encoder_layers=m.encoder_layers, decoder_layers=m.decoder_layers, d_model=m.d_model,
                ffn_dim=m.ffn_dim, num_heads=m.num_heads, normalize_before=m.normalize_before, use_glu=m.use_glu,
                encoder_mixer=m.encoder_mixer, decoder_mixer=m.decoder_mixer,
                encoder_kernel_sizes=tuple(m.encoder_kernel_sizes), decoder_kernel_sizes=tuple(m.decoder_kernel_sizes),
                share_embeddings=m.share_embeddings, dropout=m.dropout, weight_dropout=m.weight_dropout,
                weight_softmax=m.weight_softmax, learned_positions=m.learned_positions, conv_features=m.conv_features)
    return [f"{k}: fairseq {fields.get(k)!r}, lconv {v!r}" for k, v in want.items() if fields.get(k) != v]


# ----------------------------------------------------------------------------------------------------------------
# The workers: each builds its system, reports its first update, then runs windows on request
# ----------------------------------------------------------------------------------------------------------------
def serve(step, tokens_per_step: int, launched: float, extra: dict[str, Any], profile=None) -> None:
    """Runs one step (the first update), reports it on stdout, then answers ``run N`` / ``profile N`` / ``quit``
    lines from stdin, one JSON line each."""
    step()
    say(dict(event="ready", first_update_s=time.time() - launched, tokens_per_step=tokens_per_step, **extra))
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "quit":
            break
        n = int(rest[0])
        if command == "matmul":
            from lconv.bench import timing

            say(dict(event="matmul", flops_per_s=timing.matmul_flops_per_s(2048, repeats=5)["matmul_flops_per_s"]))
            continue
        if command == "profile":
            say(dict(event="profile", **profile(n)))
            continue
        start = time.perf_counter()
        for _ in range(n):
            step()
        say(dict(event="window", steps=n, seconds=time.perf_counter() - start))


def profiler():
    """``vs_fairseq_profile`` beside this file (imported only with ``--profile``)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vs_fairseq_profile

    return vs_fairseq_profile


def say(message: dict[str, Any]) -> None:
    print("@@" + json.dumps(message), flush=True)


def lconv_worker(settings: Settings, launched: float) -> None:
    from lconv.run import host_memory

    host_memory.reuse_freed_memory()  # as train.py does, before the backend is up
    import jax
    import numpy as np

    from lconv.run import compilation_cache, model_setup, schema

    compilation_cache.check_chosen()  # an entry is code: never from a folder another user could fill
    from lconv.train import setup, update

    config = schema.validate_config(lconv_config(settings))
    model = model_setup.build_model(config, config.data.vocab_size)
    tx, lr = update.build_optimizer(config.optim, config.train.num_steps)
    mesh = model_setup.make_mesh(config.mesh, jax.devices()[:1])
    state, shardings = setup.create_state(config, model, mesh, tx)
    train_step = update.jit_train_step(config, lr, shardings, mesh)
    batch = packed_batch(settings, config.data.batch_size, getattr(config.data, ROW_LENGTH_KEY), config.data.vocab_size)
    holder, lr_factor = {"state": state}, np.float32(1.0)
    compiled = train_step.lower(state, batch, lr_factor).compile()  # what the first call would compile

    def step():
        holder["state"], sums = compiled(holder["state"], batch, lr_factor)
        return float(sums["loss"])  # the host waits for the update, as fairseq's does

    def profile(n):
        return profiler().lconv_profile(step, compiled, n)

    params = model_setup.count_params(state.params)
    serve(step, int(batch["targets_segmentation"].astype(bool).sum()), launched, dict(params=params), profile)


def packed_batch(settings: Settings, rows: int, row_length: int, vocab: int) -> dict[str, Any]:
    """``settings.sentences`` random pairs of ``settings.length`` tokens (EOS last) packed into ``rows`` rows of
    ``row_length``: ids, segmentation (1.. per sentence, 0 at padding) and positions, as lconv's pipeline packs."""
    import numpy as np

    per_row = row_length // settings.length
    if settings.sentences > rows * per_row:
        raise SystemExit(f"{settings.sentences} sentences of {settings.length} do not fit {rows} rows of {row_length}")
    rng = np.random.default_rng(settings.seed)
    batch = {}
    for key in ("inputs", "targets"):
        ids, seg, pos = (np.zeros((rows, row_length), np.int32) for _ in range(3))
        sentences = rng.integers(4, vocab, (settings.sentences, settings.length), dtype=np.int32)
        sentences[:, -1] = 2  # lconv's EOS id
        for i, sentence in enumerate(sentences):
            r, slot = divmod(i, per_row)
            span = slice(slot * settings.length, (slot + 1) * settings.length)
            ids[r, span], seg[r, span], pos[r, span] = sentence, slot + 1, np.arange(settings.length)
        batch.update({key: ids, f"{key}_segmentation": seg, f"{key}_position": pos})
    return batch


def fairseq_worker(settings: Settings, launched: float, args: dict[str, Any], vocab: int) -> None:
    import tempfile

    import numpy as np
    import torch
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.trainer import Trainer

    data = tempfile.mkdtemp(prefix="vs_fairseq_")
    for lang in ("en", "de"):  # 4 specials + these = vocab (a multiple of 8, so no padding words are added)
        with open(os.path.join(data, f"dict.{lang}.txt"), "w") as f:
            f.writelines(f"w{i} 1\n" for i in range(vocab - 4))
    argv = [data, "--task", "translation", "--source-lang", "en", "--target-lang", "de", "--cpu",
            "--seed", str(settings.seed), "--max-tokens", str(4 * settings.tokens), "--num-workers", "0"]
    argv += command_line(args)
    parsed = options.parse_args_and_arch(options.get_training_parser(), input_args=argv)
    cfg = convert_namespace_to_omegaconf(parsed)
    task = tasks.setup_task(cfg.task)
    model, criterion = task.build_model(cfg.model), task.build_criterion(cfg.criterion)
    trainer = Trainer(cfg, task, model, criterion)
    sample = fairseq_sample(settings, vocab, np, torch)

    def step():
        trainer.train_step([sample])

    def profile(n):
        return profiler().fairseq_profile(step, model, criterion, n)

    params = sum(p.numel() for p in model.parameters())
    serve(step, int(sample["ntokens"]), launched, dict(params=params, torch_threads=torch.get_num_threads()),
          profile)


def command_line(args: dict[str, Any]) -> list[str]:
    """fairseq's command-line form of ``args`` (booleans that are store-true flags given bare)."""
    store_true = {"share_all_embeddings", "encoder_normalize_before", "decoder_normalize_before",
                  "encoder_learned_pos", "decoder_learned_pos"}
    out = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if key in store_true:
            out += [flag] if value else []
        elif isinstance(value, list):
            out += [flag, str(value).replace(" ", "") if key.endswith("list") else ",".join(map(str, value))]
        else:
            out += [flag, str(value)]
    return out


def fairseq_sample(settings: Settings, vocab: int, np, torch) -> dict[str, Any]:
    """The same sentences as ``packed_batch`` (fairseq's ids: EOS 2, pad 1), one unpadded ``[N, length]`` batch."""
    rng = np.random.default_rng(settings.seed)
    n, L = settings.sentences, settings.length
    src = rng.integers(4, vocab, (n, L), dtype=np.int64)
    tgt = rng.integers(4, vocab, (n, L), dtype=np.int64)
    src[:, -1] = tgt[:, -1] = 2
    prev = np.concatenate([np.full((n, 1), 2, np.int64), tgt[:, :-1]], axis=1)  # EOS first, as fairseq shifts
    return {"id": torch.arange(n), "nsentences": n, "ntokens": n * L,
            "net_input": {"src_tokens": torch.from_numpy(src), "src_lengths": torch.full((n,), L),
                          "prev_output_tokens": torch.from_numpy(prev)},
            "target": torch.from_numpy(tgt)}


# ----------------------------------------------------------------------------------------------------------------
# The driver: launches the workers one after the other, then alternates their windows
# ----------------------------------------------------------------------------------------------------------------
class Worker:
    """A system's process: JSON messages on stdout (lines starting ``@@``), its log in a temporary file."""

    def __init__(self, name: str, command: list[str], env: dict[str, str]):
        import tempfile

        self.name, self.log = name, tempfile.NamedTemporaryFile("w+", prefix=f"vs_fairseq_{name}_", suffix=".log")
        launched = time.time()
        self.proc = subprocess.Popen(command + ["--launched", repr(launched)], env=env, cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self.ready = self.receive()

    def receive(self) -> dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        self.log.seek(0)
        tail = "".join(self.log.readlines()[-15:])
        raise SystemExit(f"the {self.name} worker ended without answering (exit {self.proc.wait()}):\n{tail}")

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.receive()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def worker_env(settings: Settings, name: str) -> tuple[list[str], dict[str, str]]:
    """The command prefix (``taskset`` when pinned) and environment of a system's worker."""
    from lconv import shared_folders

    env = shared_folders.child_environment(ROOT)
    flags = [env.get("XLA_FLAGS", ""), settings.lconv_xla_flags if name == "lconv" else ""]
    if settings.mode == "pinned":
        flags.append("--xla_cpu_multi_thread_eigen=false")
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", VS_FAIRSEQ_THREADS="1")
    env["XLA_FLAGS"] = " ".join(f for f in flags if f)
    prefix = ["taskset", "-c", str(settings.core)] if settings.mode == "pinned" else []
    return prefix, env


def fairseq_missing(python: str) -> str | None:
    """Why fairseq cannot be timed (one line), or None."""
    if not python:
        return "fairseq not timed: no --fairseq_python (a Python with torch and fairseq 0.12.2)"
    probe = subprocess.run([python, "-P", "-c", "import torch, fairseq.models.lightconv"], capture_output=True,
                           text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"fairseq not timed: {python} cannot import it ({last[:150]})"
    return None


def start(settings: Settings, name: str, extra: list[str]) -> Worker:
    prefix, env = worker_env(settings, name)
    python = sys.executable if name == "lconv" else settings.fairseq_python
    command = prefix + [python, os.path.abspath(__file__), "--worker", name,
                        "--settings", json.dumps(dataclasses.asdict(settings))] + extra
    worker = Worker(name, command, env)
    print(f"  {name}: first update {worker.ready['first_update_s']:.1f} s after launch, "
          f"{worker.ready['params']:,} parameters, {worker.ready['tokens_per_step']} target tokens a step",
          file=sys.stderr)
    return worker


def alternate(settings: Settings, workers: dict[str, Worker]) -> dict[str, list[float]]:
    """Windows of ``settings.window_steps`` updates, the systems in turn, until ``settings.minutes`` are spent;
    each system's tokens/s per window."""
    rates = {name: [] for name in workers}
    deadline = time.time() + 60 * settings.minutes
    while time.time() < deadline or any(len(r) < 2 for r in rates.values()):
        for name, worker in workers.items():
            window = worker.ask(f"run {settings.window_steps}")
            rates[name].append(window["steps"] * worker.ready["tokens_per_step"] / window["seconds"])
        print("  " + ", ".join(f"{n} {r[-1]:,.0f}" for n, r in rates.items()) + " tokens/s", file=sys.stderr)
    return rates


def host_text() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, 1-minute load average {os.getloadavg()[0]:.1f} at start"


def report(settings: Settings, workers: dict[str, Worker], rates: dict[str, list[float]], matmul: float,
           note: str | None) -> str:
    names = list(workers)
    median = {n: statistics.median(rates[n]) for n in names}
    windows = min(len(r) for r in rates.values())
    mode = (f"pinned to core {settings.core}, one thread each" if settings.mode == "pinned" else
            f"all {os.cpu_count()} cores")
    lines = [f"**lconv vs fairseq 0.12.2, training step, {mode}** (`scripts/vs_fairseq.py --mode={settings.mode}`): "
             f"{host_text()}; float32 matmul {matmul / 1e9:.0f} GFLOP/s (lconv.bench's [2048]^2 rate, same "
             f"mode); {settings.sentences} sentence pairs of {settings.length} tokens a step; {windows} windows of "
             f"{settings.window_steps} updates each, alternating.", "",
             "| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|",
             "| parameters | " + " | ".join(f"{workers[n].ready['params']:,}" for n in names) + " |",
             "| first update, from launch | " + " | ".join(f"{workers[n].ready['first_update_s']:.1f} s"
                                                         for n in names) + " |",
             "| target tokens/s (median of windows) | " + " | ".join(f"{median[n]:,.0f}" for n in names) + " |",
             "| tokens/s range over windows | " + " | ".join(f"{min(rates[n]):,.0f}-{max(rates[n]):,.0f}"
                                                           for n in names) + " |"]
    if "fairseq" in median:
        lines.append(f"| lconv / fairseq tokens/s | {median['lconv'] / median['fairseq']:.2f}x | |")
    if note:
        lines += ["", note]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(Settings):
        kind = {"bool": None, "int": int, "float": float}.get(str(field.type), str)
        if kind is None:
            p.add_argument(f"--{field.name}", action="store_true")
        else:
            p.add_argument(f"--{field.name}", type=kind, default=field.default)
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    p.add_argument("--fairseq_model", help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.settings:
        return opts, Settings(**json.loads(opts.settings))
    if opts.mode not in ("pinned", "all"):
        p.error(f"--mode is pinned or all; got {opts.mode}")
    return opts, Settings(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(Settings)})


def main(argv: list[str] | None = None) -> None:
    opts, settings = parse(argv)
    if opts.worker == "lconv":
        return lconv_worker(settings, opts.launched)
    if opts.worker == "fairseq":
        model = json.loads(opts.fairseq_model)
        if os.environ.get("VS_FAIRSEQ_THREADS"):
            import torch

            torch.set_num_threads(int(os.environ["VS_FAIRSEQ_THREADS"]))
        return fairseq_worker(settings, opts.launched, model["args"], model["vocab"])
    config = lconv_config(settings)
    args = fairseq_args(config)
    mismatched = check_mapping(args, config)
    if mismatched:
        raise SystemExit(f"the fairseq arguments would build another model: {'; '.join(mismatched)}")
    note = fairseq_missing(settings.fairseq_python)
    if note:
        print(note)
    workers = {"lconv": start(settings, "lconv", [])}
    if not note:
        model = json.dumps(dict(args=args, vocab=config.data.vocab_size))
        workers["fairseq"] = start(settings, "fairseq", ["--fairseq_model", model])
    try:
        matmul = [workers["lconv"].ask("matmul 0")["flops_per_s"]]
        rates = alternate(settings, workers)
        matmul.append(workers["lconv"].ask("matmul 0")["flops_per_s"])
        print(report(settings, workers, rates, max(matmul), note))
        if settings.profile:
            found = {name: w.ask(f"profile {settings.profile_steps}") for name, w in workers.items()}
            print("\n" + profiler().table(found, settings))
    finally:
        for worker in workers.values():
            worker.close()


if __name__ == "__main__":
    main()
