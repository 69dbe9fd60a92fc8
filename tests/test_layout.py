"""The package's shape, checked from its source (AST: function-level imports and imports by name included): layers
that only import downwards, no import cycle, no file over 500 lines, no function over 80, annotations on public
functions.

The layers, bottom to top (a module may import its own layer's package and any layer below):
    0  lconv (the root), lconv.constants, lconv.errors        facts and the error type every layer shares
    1  lconv.ops (pure jnp), lconv.data (corpus, tokenizer, pipeline)
    2  lconv.nn        modules, the mixer registry, the models
    3  lconv.infer     search, decoding a split, scoring
    4  lconv.run       a run as every layer above reads it: the config schema, reading a stored config, building
                       the model and its mesh, the workdir and checkpoints, restoring trained params, the loss pass
    5  lconv.configs   the shipped configs (the repository's configs/), their defaults
       lconv.train     building a training run, the train step, the loop
       lconv.testing   the mixer contract as an executable checker (``check_mixer``), with the base mesh rules
    6  lconv.cli, lconv.bench, lconv.api, lconv.export           what the programs run; a trained run as an object,
                                                                 or exported for serving
       lconv.interop   fairseq checkpoints read and written as lconv workdirs
    7  lconv.train.__main__, lconv.evaluate, lconv.export.__main__   the programs (on lconv.cli)
       lconv.data.__main__ (its defaults are the default config's, so it prepares what training reads)
       lconv.import_fairseq
       lconv.study     the reproduction study (``python -m lconv.study``), above train/infer/cli/bench
The surfaces (api, export, cli, bench, study, interop and the programs on them) stand on lconv.run and never import
lconv.train; a bench or study module that trains imports training's entry points only (``TRAINERS``).
The root's ``lconv.load`` is a lazy attribute (PEP 562, ``importlib``): ``import lconv`` imports nothing above it.
"""
from __future__ import annotations

import ast
import functools
import json
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = {"lconv": 0, "lconv.constants": 0, "lconv.errors": 0, "lconv.ops": 1, "lconv.data": 1, "lconv.nn": 2,
          "lconv.infer": 3, "lconv.run": 4, "lconv.configs": 5, "lconv.train": 5, "lconv.testing": 5,
          "lconv.cli": 6, "lconv.bench": 6, "lconv.api": 6, "lconv.export": 6, "lconv.interop": 6,
          "lconv.train.__main__": 7, "lconv.export.__main__": 7, "lconv.data.__main__": 7,
          "lconv.evaluate": 7, "lconv.import_fairseq": 7, "lconv.study": 7}
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


def _modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted((root / "lconv").rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _group(module: str) -> str:
    """The layer a module belongs to: its longest prefix in LAYERS."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no layer; add its package to LAYERS in tests/test_layout.py")


def _imported_names(tree: ast.AST, package: str = "") -> set[str]:
    """Every dotted name a source imports: import statements (relative ones against ``package``), and
    ``importlib.import_module(...)`` / ``__import__(...)`` calls by the constant start of their argument."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if not package:
                    continue
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # By the names: ``from lconv import train`` imports lconv.train, ``from lconv.run import x`` lconv.run.
            names.update(f"{base}.{alias.name}" if base else alias.name for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")):
            arg = node.args[0]
            first = arg.values[0] if isinstance(arg, ast.JoinedStr) and arg.values else arg
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and first.value:
                names.add(first.value.rstrip("."))  # f"lconv.configs.{family}" imports from lconv.configs
    return names


def _imports(module: str, modules: dict[str, pathlib.Path] = MODULES) -> set[str]:
    """The lconv modules and packages ``module`` imports anywhere in its body, statically or by name. A folder
    without ``__init__.py`` is a package too, so ``from lconv import train`` is an import of ``lconv.train``."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    known = {".".join(name.split(".")[:n]) for name in modules for n in range(1, name.count(".") + 2)}
    found = set()
    for target in _imported_names(ast.parse(path.read_text(encoding="utf-8")), package):
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != module and not module.startswith(target + "."):
            found.add(target)
    return found


def _graph(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    return {module: _imports(module, modules) for module in modules}


@functools.cache
def _lconv_graph() -> dict[str, set[str]]:
    """lconv's import graph, parsed when a test first asks (not at collection, which every xdist worker runs)."""
    return _graph(MODULES)


# The root's PEP 562 attributes import these on first use, so ``import lconv`` itself imports nothing above it.
LAZY_ATTRIBUTES = {("lconv", "lconv.api"), ("lconv", "lconv.nn.mixers")}


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        group = _group(module)
        for target in targets:
            target_group = _group(target)
            if (module, target) in LAZY_ATTRIBUTES:
                continue
            if LAYERS[target_group] > LAYERS[group]:
                wrong.append(f"{module} (layer {LAYERS[group]}) imports {target} (layer {LAYERS[target_group]})")
            elif LAYERS[target_group] == LAYERS[group] and target_group != group and LAYERS[group] > 0:
                wrong.append(f"{module} imports {target}, a sibling package of the same layer")
    return wrong


def test_every_import_points_down_or_stays_in_its_package():
    wrong = _layer_violations(_lconv_graph())
    assert not wrong, "\n".join(wrong)


# The surfaces stand on lconv.run (a run's config, model, checkpoints, restore, loss pass), never on lconv.train:
# changing how a run trains cannot break evaluating, loading, exporting or importing one.
SURFACES = ("lconv.api", "lconv.export", "lconv.evaluate", "lconv.import_fairseq", "lconv.cli", "lconv.interop",
            "lconv.bench", "lconv.study")
# What a surface that trains may import (training's entry points), and why each such module trains.
TRAINING_ENTRY = ("lconv.train.loop", "lconv.train.update", "lconv.train.setup")
TRAINERS = {"lconv.bench.train": "times the train step", "lconv.bench.gpu": "times training runs",
            "lconv.study.measure": "times each study task's train step", "lconv.study.run": "trains the study's runs",
            "lconv.study.speed": "times every mixer's train step side by side",
            "lconv.interop.fairseq_replay": "replays a recorded fairseq-train run through the train step"}


def _surface_violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        if not any(module == s or module.startswith(s + ".") for s in SURFACES):
            continue
        for target in sorted(t for t in targets if t == "lconv.train" or t.startswith("lconv.train.")):
            if module in TRAINERS and target in TRAINING_ENTRY:
                continue  # it trains (TRAINERS says why), through training's entry points only
            wrong.append(f"{module} imports {target}: a surface imports lconv.run (config, model, restore), never "
                         "lconv.train" + (f" beyond {', '.join(TRAINING_ENTRY)}" if module in TRAINERS else ""))
    return wrong


def test_surfaces_never_import_train():
    wrong = _surface_violations(_lconv_graph())
    assert not wrong, "\n".join(wrong)


def test_export_never_imports_the_cli():
    """The export library is a surface beside the CLIs; only its program (``python -m lconv.export``) uses them."""
    wrong = [f"{module} imports {target}" for module, targets in _lconv_graph().items()
             if module == "lconv.export" or (module.startswith("lconv.export.") and module != "lconv.export.__main__")
             for target in sorted(targets) if target == "lconv.cli" or target.startswith("lconv.cli.")]
    assert not wrong, "\n".join(wrong)


def _sources() -> dict[str, str]:
    """The Python a checkout runs: the package, scripts, tests, the top-level programs, the notebooks' cells."""
    sources = {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8")
               for folder in ("lconv", "scripts", "tests") for p in sorted((ROOT / folder).rglob("*.py"))}
    sources.update({p.name: p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("*.py"))})
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        sources[str(path.relative_to(ROOT))] = "\n".join(  # IPython's magics and shell lines are not Python
            line for cell in code for line in cell.splitlines() if not line.lstrip().startswith(("%", "!")))
    return sources


def test_everything_imports_the_configs_as_lconv_configs():
    """``configs`` is a top-level package only in a checkout (``lconv/configs`` links to it), and importing a file
    both as ``configs.X`` and ``lconv.configs.X`` makes two module objects of it: one name, ``lconv.configs``."""
    wrong = []
    for where, text in _sources().items():
        wrong += [f"{where} imports {name}" for name in _imported_names(ast.parse(text))
                  if name.split(".")[0] == "configs"]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    state: dict[str, str] = {}
    cycles = []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(_lconv_graph()[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state and target in _lconv_graph():  # a folder without __init__.py runs no code
                visit(target, path + [target])
        state[module] = "done"

    for module in MODULES:
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_layer_check_can_fail():
    """The checker sees a real upward import (so the tests above are not vacuous)."""
    assert "lconv.nn.models" in _lconv_graph()["lconv.run.model_setup"]
    assert LAYERS[_group("lconv.run.model_setup")] > LAYERS[_group("lconv.nn.models")]


def _copy_of_the_package(tmp_path: pathlib.Path) -> pathlib.Path:
    shutil.copytree(ROOT / "lconv", tmp_path / "lconv",  # the sources only (lconv/configs is a link: its files)
                    ignore=lambda folder, names: [n for n in names if not n.endswith(".py")
                                                  and not pathlib.Path(folder, n).is_dir()])
    return tmp_path


# Each way of importing upwards, planted in a low layer (lconv.nn) and in a surface (lconv.api).
PLANTED = {"a static import": "import lconv.train.setup",
           "a from-import of a folder without __init__.py": "from lconv import train",
           "a relative from-import of that folder": "from {parent} import train",
           "importlib.import_module": "importlib.import_module('lconv.train.setup')",
           "import_module of an f-string": "importlib.import_module(f'lconv.train.{name}')",
           "__import__": "__import__('lconv.train.setup')"}


@pytest.mark.parametrize("how", sorted(PLANTED))
def test_the_checks_fail_on_each_planted_import(tmp_path, how):
    """The checks above see each kind of import (so their passing is not vacuous): planted in a copy of the package,
    the import fails the layer check from lconv.nn and the surface check from lconv.api."""
    root = _copy_of_the_package(tmp_path)  # unplanted, it passes (the tests above)
    for module, parent in (("nn/common.py", ".."), ("api.py", ".")):
        path = root / "lconv" / module
        planted = PLANTED[how].replace("{parent}", parent)
        path.write_text(path.read_text(encoding="utf-8") + f"\n\ndef _planted(name):\n    {planted}\n")
    graph = _graph(_modules(root))
    assert any(v.startswith("lconv.nn.common (layer 2) imports lconv.train") for v in _layer_violations(graph))
    assert any(v.startswith("lconv.api imports lconv.train") for v in _surface_violations(graph))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_files_and_functions_stay_small(module):
    source = MODULES[module].read_text(encoding="utf-8")
    assert len(source.splitlines()) <= MAX_FILE_LINES, f"{MODULES[module]} has over {MAX_FILE_LINES} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{MODULES[module]}: functions over {MAX_FUNCTION_LINES} lines: {long}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_public_functions_are_annotated(module):
    """Every public module-level function and public method: each argument (but self/cls) and the return."""
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    bare = []
    scopes = [tree] + [node for node in tree.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]
    for scope in scopes:
        for node in scope.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            args += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
            missing = [a.arg for a in args if a.annotation is None and a.arg not in ("self", "cls")]
            if node.returns is None and node.name != "__init__":
                missing.append("return")
            if missing:
                bare.append(f"{node.name}: {missing}")
    assert not bare, f"{MODULES[module]}: unannotated {bare}"
