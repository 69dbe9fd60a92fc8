"""Process set-up shared by the entry points: multi-host initialisation, the compilation cache and one-line user
errors."""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

from lconv import command_files, console, outputs
from lconv.cli import flag_files
from lconv.data import paths
from lconv.errors import UserError
from lconv.run import compilation_cache, host_memory
from lconv.run.backend import check_backend  # noqa: F401 (the CLIs' name for it)


def cluster_environment(environ: Mapping[str, str] | None = None) -> str | None:
    """The multi-process launcher this process was started by, or None for a single process.

    ``lconv``: the manual fallback, ``LCONV_NUM_PROCESSES`` > 1 with ``LCONV_COORDINATOR`` and
    ``LCONV_PROCESS_ID``. ``slurm`` (``srun`` with more than one task), ``openmpi`` (``mpirun -np`` > 1),
    ``tpu`` (a Cloud TPU pod slice or multislice): ``jax.distributed.initialize()`` reads each from the
    environment. Checked in that order; one task under SLURM or MPI is a single process.
    """
    env = os.environ if environ is None else environ

    def count(name: str) -> int:
        try:
            return int(env.get(name, "1"))
        except ValueError:
            raise UserError(f"environment variable {name}={env[name]!r} must be a process count") from None

    if count("LCONV_NUM_PROCESSES") > 1:
        return "lconv"
    if "SLURM_JOB_ID" in env and "SLURM_STEP_NODELIST" in env and count("SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and count("OMPI_COMM_WORLD_SIZE") > 1:
        return "openmpi"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    return None


def initialize() -> None:
    """``jax.distributed.initialize`` when this process is one of several (``cluster_environment``), after
    ``host_memory.reuse_freed_memory`` (before any backend is up)."""
    host_memory.reuse_freed_memory()
    import jax

    cluster = cluster_environment()
    if cluster == "lconv":
        missing = [v for v in ("LCONV_COORDINATOR", "LCONV_PROCESS_ID") if v not in os.environ]
        if missing:
            raise UserError(f"LCONV_NUM_PROCESSES={os.environ['LCONV_NUM_PROCESSES']} needs {' and '.join(missing)} "
                            "too (the coordinator's host:port and this process's index)")
        processes, index = int(os.environ["LCONV_NUM_PROCESSES"]), os.environ["LCONV_PROCESS_ID"].strip()
        if not (index.isdigit() and int(index) < processes):
            raise UserError(f"LCONV_PROCESS_ID={os.environ['LCONV_PROCESS_ID']!r} must be this process's index, 0 to "
                            f"{processes - 1} (LCONV_NUM_PROCESSES={processes})")
        host, _, port = os.environ["LCONV_COORDINATOR"].rpartition(":")
        if not (host and port.isdigit() and 1 <= int(port) <= 65535):  # a port past 65535 was a silent wait
            raise UserError(f"LCONV_COORDINATOR={os.environ['LCONV_COORDINATOR']!r} must be the coordinator's "
                            "host:port (port 1-65535)")
        # jax.distributed says nothing while it waits for the others: a wrong address looked like a hang.
        logging.getLogger(__name__).info(f"process {index} of {processes}: waiting for the coordinator at "
                                            f"{os.environ['LCONV_COORDINATOR']} and the other processes")
        # CPU devices of different processes talk over gloo (TPU/GPU use their own interconnect regardless).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # Each CPU program runs to its end before the next is dispatched. With JAX's async CPU dispatch, programs
        # holding collectives (a train or eval step, a psum barrier) can be in flight together and reach gloo in
        # different orders on different processes: a CI run hung that way inside the final validation, both
        # processes waiting (jax-ml/jax#25861 reports hangs of CPU async dispatch even in one process).
        jax.config.update("jax_cpu_enable_async_dispatch", False)
        jax.distributed.initialize(
            coordinator_address=os.environ["LCONV_COORDINATOR"],
            num_processes=processes,
            process_id=int(index),
        )
    elif cluster is not None:
        jax.distributed.initialize()  # SLURM, Open MPI, Cloud TPU: JAX reads everything from the environment
    check_backend()


COMPILATION_CACHE = compilation_cache.FOLDER_NAME  # this user's cache folder's name, and older runs' in their workdir
user_compilation_cache = compilation_cache.user_folder


def enable_compilation_cache(workdir: str, choice: str | None = None) -> str | None:
    """Keeps the programs a run compiles in a folder (JAX's persistent cache, keyed by program, options, device and
    jax version), so a resumed run or a later ``eval.py`` reads them back. Call before anything compiles.

    ``choice``: a folder (local or URL), ``"none"``, or None for ``$JAX_COMPILATION_CACHE_DIR`` else this user's
    folder (``user_compilation_cache``), never one inside ``workdir``. Returns the folder in use, or None."""
    import jax

    if choice is not None and choice.lower() == "none":
        compilation_cache.turn_off()
        return None
    if choice:
        paths.check_url(choice, "--compilation_cache")
        outputs.check_outside_outputs(choice, "--compilation_cache")
    chosen = paths.expand(choice or os.environ.get("JAX_COMPILATION_CACHE_DIR") or "")  # ~ once, for check and use
    paths.check_url(chosen, "$JAX_COMPILATION_CACHE_DIR")
    folder = chosen or user_compilation_cache()
    problem = (compilation_cache.unusable(folder) or (None if chosen else compilation_cache.make_private(folder))
               or compilation_cache.shared(folder))
    if problem and choice:
        raise UserError(f"--compilation_cache={choice}: {problem}; name a folder this process can write, or none")
    if problem:  # said once here, rather than by JAX at every compile
        source = "$JAX_COMPILATION_CACHE_DIR" if chosen else "this user's cache; --compilation_cache=DIR names another"
        logging.getLogger(__name__).warning(f"compiled programs are not kept: {folder} {problem} ({source})")
        compilation_cache.turn_off()
        return None
    old = os.path.join(workdir, COMPILATION_CACHE)
    if not paths.is_url(workdir) and os.path.isdir(old) and os.path.realpath(old) != os.path.realpath(folder):
        logging.getLogger(__name__).info(f"{old} is not read (a cache entry is code, a workdir is data); "
                                         f"compiled programs are kept in {folder}")
    jax.config.update("jax_compilation_cache_dir", folder)
    compilation_cache.report_cache_errors(folder)
    return folder


EARLY_BUILD_THREAD = "lconv-early-build"  # ``lconv.train.early_build``'s thread: alive while it builds


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A ``UserError`` (a config field, a flag, a file, a checkpoint) ends the program with its one line and exit
    code 2; Ctrl-C ends it with exit code 130 and no traceback (``on_interrupt`` while the body runs); any other
    exception keeps its traceback, since it is a bug to report rather than an input to fix."""
    installed = _install_interrupt_handler()
    try:
        yield
    except UserError as err:
        print(f"error: {console.printable(str(err))}", file=sys.stderr)
        _exit(2)
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (which checkpoints and stops by itself)
        print("interrupted", file=sys.stderr)
        if installed:  # exit handlers run last-registered first: a second Ctrl-C in JAX's was a traceback
            atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
        _exit(130)
    finally:
        if installed:
            with contextlib.suppress(ValueError):
                if signal.getsignal(signal.SIGINT) is on_interrupt:
                    signal.signal(signal.SIGINT, signal.default_int_handler)


_INTERRUPTS: list[int] = []  # the Ctrl-Cs ``on_interrupt`` has seen since ``user_errors`` installed it


def _install_interrupt_handler() -> bool:
    """``on_interrupt`` as the SIGINT handler, only over Python's default (never over SIG_IGN, a background job's,
    or a caller's own handler) and in the main thread; True when installed."""
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        signal.signal(signal.SIGINT, on_interrupt)
    except ValueError:  # not the main thread
        return False
    _INTERRUPTS.clear()
    return True


def on_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C outside the training loop (whose ``Preemption`` takes SIGINT over while it runs): a KeyboardInterrupt
    as usual, but where one cannot end the program it ends the process at once with ``interrupted`` and code 130:
    a second Ctrl-C (the first was lost: raised inside a gc callback such as JAX's, Python ignores it), while one
    of lconv's compile threads runs (the interpreter would wait for it), or while a checkpoint is being written
    (the loop's own save after a first Ctrl-C: the write is dropped, its folder removed at the next start)."""
    del frame
    _INTERRUPTS.append(signum)
    writing = _writing_checkpoints()
    if writing:  # a KeyboardInterrupt in orbax's wait was a traceback from its threads and a folder left behind
        print(f"interrupted while checkpoint {writing[0]} was being written: it is dropped (the next run removes "
              "what it left and resumes from the last complete checkpoint)", file=sys.stderr)
        _exit_now(130)
    if len(_INTERRUPTS) > 1 or _compiling():
        print("interrupted", file=sys.stderr)
        _exit_now(130)
    raise KeyboardInterrupt


def _exit_now(code: int) -> NoReturn:
    """Ends the process without unwinding or joining threads, its logs and output flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit(code: int) -> NoReturn:
    """``sys.exit(code)``, or at once while one of lconv's compile threads runs (the early build's, the
    translator's): the interpreter would wait for every compilation queued there, and a second Ctrl-C in that
    wait is a threading traceback. Nothing they build outlives the process, so there is nothing to wait for."""
    if _compiling():
        _exit_now(code)
    sys.exit(code)


def _writing_checkpoints() -> list[str]:
    """The checkpoints being written now (``lconv.run.checkpoints.writing``; looked up only if imported)."""
    checkpoints = sys.modules.get("lconv.run.checkpoints")
    return checkpoints.writing() if checkpoints is not None else []


def _compiling() -> bool:
    """Whether the early build or the translator's thread is compiling (looked up only if imported)."""
    if any(t.name.startswith(EARLY_BUILD_THREAD) and t.is_alive() for t in threading.enumerate()):
        return True
    compiled = sys.modules.get("lconv.infer.compiled")
    return compiled is not None and compiled.compiling()


CONFIG_LIMIT_BYTES = 1 << 24  # far past any config file
_HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpfull", "-helpfull", "--helpshort", "-helpshort")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing for ``app.run(..., flags_parser=parse_flags)``, with bad flags, config files that do not
    load (missing, a syntax error, an unknown ``:variant``) and ``--config.*`` overrides (unknown field, wrong type)
    reported in one line instead of a traceback."""
    from absl import flags

    try:  # a --flagfile's flags are resolved as the command line's, and read by lconv alone (lconv.cli.flag_files)
        expanded = flag_files.expand(argv)
        resolved = resolve_config_argument(expanded)
    except UserError as err:
        console.exit_with(str(err))
    if argv == sys.argv:  # ml_collections reads --config.* overrides from sys.argv: no flag file left for it either
        sys.argv[:] = expanded
    try:
        remaining = flags.FLAGS(resolved)
    except SystemExit as exit_:
        # absl prints --help/--helpfull/--helpshort and exits 1; asking for help is a success (exit 0).
        if exit_.code == 1 and any(a.split("=")[0] in _HELP_FLAGS for a in argv[1:]):
            raise SystemExit(0) from None
        raise
    except Exception as err:  # noqa: BLE001 (every flag and config-file error is an input to fix)
        console.exit_with(_flag_error_line(err, argv))
    if len(remaining) > 1:  # absl's UsageError would print the whole --help and exit 1
        extra = ' '.join(remaining[1:])
        console.exit_with(f"unexpected argument{'s' if len(remaining) > 2 else ''} {extra}: every setting is a flag, "
                          "--name=value (see --help)")
    config_arg = next((a for a in argv[1:] if a.startswith("--config=")), None)
    if config_arg is not None and "config" in flags.FLAGS:
        try:  # ml_collections defers a config file's load error to the first use of the config
            value = flags.FLAGS["config"].value
            value.keys()
        except OSError as err:
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            console.exit_with(f"{config_arg}: {lines[-1] if lines else type(err).__name__}")
        except AttributeError:
            console.exit_with(f"{config_arg}: get_config() returned {type(value).__name__} {value!r:.40}; it must "
                              "return an ml_collections.ConfigDict (start from lconv.configs.common.base_config())")
    return remaining


def expand_flag_files() -> None:
    """``sys.argv`` with its flag files' flags in their place (``lconv.cli.flag_files``), or one line (exit 2): for
    a program whose ml_collections config flag, defined next, reads the command line before ``parse_flags`` runs."""
    try:
        sys.argv[:] = flag_files.expand(sys.argv)
    except UserError as err:
        console.exit_with(str(err))


def packaged_configs() -> list[str]:
    """The configs shipped with lconv (``lconv.configs``: the repository's configs/ folder), by name."""
    return sorted(name.removesuffix(".py") for name in os.listdir(_packaged_config_dir())
                  if name.endswith(".py") and name not in ("__init__.py", "common.py", "schema.py"))


def _packaged_config_dir() -> str:
    import importlib.util

    return list(importlib.util.find_spec("lconv.configs").submodule_search_locations)[0]


def resolve_config_argument(argv: list[str]) -> list[str]:
    """``--config=NAME[:ARGS]`` naming a packaged config (``default``, ``wmt_en_de.py``) -> the packaged file's
    path, which is what ml_collections loads: ``python -m lconv.train --config=default`` works from any directory,
    whatever it holds (a file of that name there is ``./default``). Any other name is a file, kept as it is once it
    is found to be this user's (ml_collections names a missing one)."""
    out = list(argv)
    for i, arg in enumerate(out):
        name, equals, value = arg.partition("=")
        if name not in ("--config", "-config"):  # absl takes either
            continue
        if equals:
            out[i] = f"{name}={_config_path(value)}"
        elif i + 1 < len(out):
            out[i + 1] = _config_path(out[i + 1])
    return out


def _config_path(value: str) -> str:
    name, colon, args = value.partition(":")
    packaged = os.path.join(_packaged_config_dir(), name.removesuffix(".py") + ".py")
    bare = "/" not in name and os.sep not in name
    if bare and os.path.isfile(packaged):  # a packaged name is the packaged config, whatever the folder holds
        return packaged + colon + args
    if not bare or os.path.isfile(name):
        # What is loaded is the file checked, by its resolved path: a link on the way is not followed a second time,
        # when another user could have pointed it elsewhere between the check and the load.
        return _check_config_file(name, value) + colon + args
    raise UserError(f"--config={value}: no such file, nor a config packaged with lconv; packaged: "
                    f"{', '.join(packaged_configs())}")


def _check_config_file(path: str, value: str) -> str:
    """A config file is code this process runs: the resolved path ml_collections is to load, once the file passes
    ``command_files.read_checked`` (a regular file of this user's, on a way and in a folder no other user can
    change); else one line."""
    real, _ = command_files.read_checked(path, f"--config={value}", "a config file is code that lconv would run as "
                                         "you", CONFIG_LIMIT_BYTES, code=True)
    return real


def _flag_error_line(err: BaseException, argv: list[str]) -> str:
    lines = str(err.args[0] if err.args else err).strip().splitlines() or [type(err).__name__]
    named = re.match(r"flag (--[\w.]+)=", lines[0])
    prefix = named.group(1) + "=" if named else "--config="
    arg = next((a for a in argv[1:] if a.startswith(prefix)), prefix.rstrip("="))
    cause = _root_cause(err)
    if isinstance(cause, UserError) and cause is not err:  # a config file's own check (e.g. an unknown :variant)
        return f"{arg}: {cause}"
    if cause is not err and lines[0].rstrip().endswith(":"):  # ml_collections dropped the cause's text
        return f"{arg}: {type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[-1]}"
    if isinstance(err, SyntaxError):
        return f"{arg}: SyntaxError: {err}"
    if isinstance(err, AttributeError) and "get_config" in lines[0]:
        return f"{arg}: the file defines no get_config(); a config file is a Python module with get_config(arg=None)"
    while err.args and isinstance(err.args[0], BaseException):  # ml_collections wraps its KeyError
        err = err.args[0]
    lines = str(err.args[0] if err.args else err).strip().splitlines() or [type(err).__name__]
    text = lines[0]
    if isinstance(err, (AttributeError, KeyError)):  # a --config.a.b override with no such field
        field = text.strip("'\"")
        culprit = [a for a in argv[1:] if a.startswith("--config.") and f".{field}" in a.split("=")[0]]
        text = f"{culprit[0].split('=')[0] if culprit else 'a --config override'} is not a field of the config"
        text += "".join(f"; {line.strip()}" for line in lines[1:2])  # ml_collections' "did you mean"
    return text.removeprefix("flag ")


def _root_cause(err: BaseException) -> BaseException:
    """The first ``UserError`` in ``err``'s chain of causes, else the innermost exception."""
    chain = [err]
    while (nxt := chain[-1].__cause__ or chain[-1].__context__) is not None and nxt not in chain:
        chain.append(nxt)
    users = [e for e in chain[1:] if isinstance(e, UserError) and "Traceback" not in str(e)]
    return users[-1] if users else chain[-1]


def print_summary(result: dict[str, Any]) -> None:
    import jax

    if jax.process_index() == 0 and result:
        scalars = {k: v for k, v in result.items() if not isinstance(v, dict)}
        print(json.dumps(scalars, indent=None, default=str))
