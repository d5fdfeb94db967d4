"""The layers import one way, read from the code itself: an AST walk of every module of
zerotrain/, launcher/, modeling/ and dataio/, imports inside functions included.

    0  zerotrain (__version__, resource_dir, errors, cli_args, durable, ds_attributes, torch_private, reading), the data packages ds_configs/ and recipes/
    1  modeling/*, and dataio/format/*: on-disk formats and pure helpers (errors, docstore, mix, tokenfile, shards,
       pieces, packing)
    2  dataio/sources/*: reading one source (readers, streamed, hub, tokenizer, sft, holdout)
    3  dataio/pipeline/*: the loader, reshard, prepare and `zerotrain data ...` (commands)
    5  launcher/errors (exceptions, StopRun, fail), ends (the table of how a run ends: kinds, exit codes), rank_ends
       (a rank's exit code left for `zerotrain launch`)
    6  the config layer: config (the typed tree of settings: a leaf, importing nothing of this layer or above),
       config_resolve (its validation, resolution and run id), settings (the settings table), node (the machine),
       hparams, profiles, model_spec, optimizers, client_optimizers, offload.keys
    7  launcher/components/*: the flat modules, checkpoints/ and observe/; launcher/planning/* (the planner); the
       feature rooms launcher/offload/ (its keys module, what --offload writes into the DeepSpeed dict, is in the
       config layer, 6), launcher/sequence/ and launcher/resize/
    8  launcher/components/launching/*: starting ranks and restarting jobs
    9  the run: resolution (flags to a plan, once), run_plan, trainer
    10 entry points: launcher/commands/*, cli, train, launcher/__init__ (the notebook's finetune), zerotrain/__main__

dataio and modeling never import each other (modeling sits beside dataio's lowest layer).
A module may import its own layer or below, and no module may reach itself through imports. A file
added to a folder whose modules all share a layer (components/ and its rooms, planning/, commands/, modeling/) is
placed by its folder (dataio's three sub-packages too); one added anywhere else (a module directly in dataio/
included) must be given a layer in LAYERS below, or this test says so. Also here: nothing imports the bare `launcher`,
`modeling` or `dataio` (the names the folders had before they installed as zerotrain.*), and the light
commands never load torch.
"""
from __future__ import annotations

import ast
import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# module (exact) or "package.*" (the package and every module under it) -> layer
LAYERS = {
    "zerotrain": 0, "zerotrain.ds_configs": 0, "zerotrain.recipes": 0, "zerotrain.errors": 0, "zerotrain.cli_args": 0,
    "zerotrain.durable": 0, "zerotrain.ds_attributes": 0,
    "zerotrain.torch_private": 0, "zerotrain.reading": 0,
    "zerotrain.modeling.*": 1,
    "zerotrain.dataio": 1, "zerotrain.dataio.format.*": 1, "zerotrain.dataio.sources.*": 2,
    "zerotrain.dataio.pipeline.*": 3,
    "zerotrain.launcher.errors": 5, "zerotrain.launcher.ends": 5, "zerotrain.launcher.rank_ends": 5,
    "zerotrain.launcher.config": 6, "zerotrain.launcher.profiles": 6, "zerotrain.launcher.model_spec": 6,
    "zerotrain.launcher.optimizers": 6, "zerotrain.launcher.client_optimizers": 6, "zerotrain.launcher.hparams": 6,
    "zerotrain.launcher.settings": 6, "zerotrain.launcher.node": 6, "zerotrain.launcher.config_resolve": 6,
    "zerotrain.launcher.components.*": 7,
    "zerotrain.launcher.components.launching.*": 8,
    "zerotrain.launcher.planning.*": 7,
    "zerotrain.launcher.offload": 6, "zerotrain.launcher.offload.keys": 6, "zerotrain.launcher.offload.*": 7,
    "zerotrain.launcher.sequence.*": 7, "zerotrain.launcher.resize.*": 7,
    "zerotrain.launcher.run_plan": 9, "zerotrain.launcher.trainer": 9, "zerotrain.launcher.resolution": 9,
    "zerotrain.launcher.commands.*": 10, "zerotrain.launcher.cli": 10, "zerotrain.launcher.train": 10,
    "zerotrain.launcher": 10, "zerotrain.__main__": 10,
}
LAYER_NAMES = {0: "root", 1: "modeling, dataio format", 2: "dataio sources", 3: "dataio pipeline", 5: "errors",
               6: "config layer", 7: "components", 8: "components/launching", 9: "run", 10: "entry points"}
WALLED = ("zerotrain.dataio", "zerotrain.modeling")  # neither may import the other
BARE = ("launcher", "modeling", "dataio")


def package_dirs() -> dict[str, Path]:
    """setup.cfg's package_dir: import package -> folder (zerotrain.launcher -> launcher/)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    pairs = [line.split("=") for line in cfg["options"]["package_dir"].strip().splitlines()]
    return {pkg.strip(): REPO / folder.strip() for pkg, folder in pairs}


def project_modules() -> dict[str, Path]:
    """Every importable module of the project: dotted name -> file."""
    modules = {}
    dirs = package_dirs()
    for package, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            name = ".".join((package, *rel))
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            nested = [p for p in dirs if p != package and p.startswith(package + ".") and name.startswith(p)]
            if not nested:  # a folder that is its own package in package_dir is listed under that package
                modules[name] = path
    return modules


def layer_of(module: str) -> int | None:
    if module in LAYERS:
        return LAYERS[module]
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i]) + ".*"
        if key in LAYERS:
            return LAYERS[key]
    return None


def _resolve(name: str, modules: dict) -> str | None:
    """The project module an import of `name` loads: the longest dotted prefix that is one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def imports_of(module: str, path: Path, modules: dict) -> list[tuple[str, int]]:
    """(project module imported, line) for every import in the file, at any depth (functions, classes,
    try blocks), plus importlib.import_module("literal") calls."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, `level` steps up
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name`: the submodule pkg.name if there is one, else pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for target in targets:
            resolved = _resolve(target, modules) if target.split(".")[0] == "zerotrain" else None
            if resolved is not None and resolved != module:
                found.append((resolved, node.lineno))
    return found


def import_graph() -> tuple[dict, dict]:
    modules = project_modules()
    return modules, {m: imports_of(m, p, modules) for m, p in modules.items()}


def test_every_module_has_a_layer():
    modules = project_modules()
    assert len(modules) > 40, sorted(modules)  # the walk found the project (not an empty folder)
    unplaced = [f"{p.relative_to(REPO)} ({m})" for m, p in modules.items() if layer_of(m) is None]
    assert not unplaced, (f"no layer for {', '.join(unplaced)}: give it one in LAYERS of tests/test_architecture.py"
                          f" ({', '.join(f'{k} {v}' for k, v in LAYER_NAMES.items())})")


def test_imports_go_down_only():
    modules, graph = import_graph()
    upward = []
    for module, edges in graph.items():
        here = layer_of(module)
        for target, line in edges:
            there = layer_of(target)
            if here is None or there is None:
                continue  # test_every_module_has_a_layer names it
            where = f"{modules[module].relative_to(REPO)}:{line}"
            if there > here:
                upward.append(f"{where} imports {target} (layer {there}, {LAYER_NAMES[there]}) from layer {here}"
                              f" ({LAYER_NAMES[here]})")
            for wall in WALLED:
                other = [w for w in WALLED if w != wall]
                if (module == wall or module.startswith(wall + ".")) and any(
                        target == o or target.startswith(o + ".") for o in other):
                    upward.append(f"{where} imports {target}: {wall} and {other[0]} never import each other")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)



def test_the_config_is_a_leaf():
    """launcher/config.py (the typed tree of settings) imports nothing that resolves it: no module of its own layer
    (settings, hparams, profiles, model_spec, optimizers, ...) or above, only the root helpers, errors and modeling's
    names (launcher/config_resolve.py validates, resolves and hashes it)."""
    modules, graph = import_graph()
    config = "zerotrain.launcher.config"
    above = [f"{modules[config].relative_to(REPO)}:{line} imports {target} (layer {layer_of(target)})"
             for target, line in graph[config] if layer_of(target) >= layer_of("zerotrain.launcher.errors") + 1]
    assert not above, "the config must stay a leaf:\n" + "\n".join(above)

def test_no_import_cycles():
    modules, graph = import_graph()
    edges = {m: sorted({t for t, _ in e}) for m, e in graph.items()}
    lines = {(m, t): line for m, e in graph.items() for t, line in e}
    state, stack, cycles = {}, [], []

    def visit(m):  # depth-first; a grey node met again closes a cycle
        state[m] = "grey"
        stack.append(m)
        for t in edges.get(m, []):
            if state.get(t) == "grey":
                loop = stack[stack.index(t):] + [t]
                cycles.append(" -> ".join(f"{a} ({modules[a].relative_to(REPO)}:{lines[(a, b)]})"
                                          for a, b in zip(loop, loop[1:])) + f" -> {t}")
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "black"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


DATAIO_LAYERS = ("format", "sources", "pipeline")  # dataio's sub-packages, bottom up
DATAIO_DEPTH = 7  # the longest import chain inside dataio, in modules (9 before the sub-packages)


def test_dataio_is_three_layers_and_a_short_chain():
    """Each dataio module sits in format/, sources/ or pipeline/ and imports only its own sub-package or one below,
    never zerotrain.launcher (nor modeling: test_imports_go_down_only); the longest chain of imports inside dataio
    stays short, so a reader follows a data path through a few modules, not nine."""
    modules, graph = import_graph()
    dataio = {m: sorted({t for t, _ in e}) for m, e in graph.items() if m.startswith("zerotrain.dataio.")}
    rank = {m: DATAIO_LAYERS.index(m.split(".")[2]) for m in dataio if m.split(".")[2] in DATAIO_LAYERS}
    loose = sorted(set(dataio) - set(rank))
    assert not loose, f"dataio modules outside format/, sources/, pipeline/: {loose}"
    wrong = []
    for m, targets in dataio.items():
        for t in targets:
            line = next(n for u, n in graph[m] if u == t)
            where = f"{modules[m].relative_to(REPO)}:{line}"
            if t.startswith("zerotrain.launcher"):
                wrong.append(f"{where} imports {t}: dataio sits below the launcher")
            elif t in rank and rank[t] > rank[m]:
                wrong.append(f"{where} imports {t}: dataio {DATAIO_LAYERS[rank[m]]} may import"
                             f" {', '.join(DATAIO_LAYERS[:rank[m] + 1])} only")
    assert not wrong, "dataio imports that go up:\n" + "\n".join(wrong)

    def chain(m, seen=()):  # the longest path of dataio imports from m (test_no_import_cycles rules out loops)
        return max(([m, *chain(t, (*seen, m))] for t in dataio[m] if t in dataio and t not in seen), key=len,
                   default=[m])
    longest = max((chain(m) for m in dataio), key=len)
    assert len(longest) <= DATAIO_DEPTH, (f"a {len(longest)}-deep import chain inside dataio (at most {DATAIO_DEPTH}):"
                                          f" {' -> '.join(longest)}")


def _sources() -> list[tuple[str, str]]:
    """(where, Python source) of every .py file of the repository and every notebook code cell."""
    skip = {".venv", ".git", "build", "dist", "runs", "node_modules", "__pycache__"}
    out = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if not skip & set(rel.parts) and not rel.parts[0].endswith(".egg-info"):
            out.append((str(rel), path.read_text()))
    for nb in sorted(REPO.glob("notebooks/*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] == "code":
                text = "".join(cell["source"])
                # IPython magics and shell lines are not Python
                text = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in text.splitlines())
                out.append((f"{nb.relative_to(REPO)} cell {i}", text))
    return out


def test_nothing_imports_the_bare_folder_names():
    bad = []
    for where, text in _sources():
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
                names = [str(node.args[0].value)]
            bad += [f"{where}:{node.lineno}: {n}" for n in names if n.split(".")[0] in BARE]
    assert not bad, "imports of the bare folder names (use zerotrain.launcher / .modeling / .dataio):\n" + "\n".join(bad)


def _bound_names(path: Path) -> set[str]:
    """Names a module binds at its top level (inside if/try blocks too, not inside functions or classes),
    plus those its module-level __getattr__ answers (a string it compares the name with)."""
    names, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":
                names |= {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return names


def test_every_import_of_zerotrain_resolves():
    """After modules move, no test, benchmark, notebook cell or module keeps an old path:
    each `import zerotrain.X` names a module, each `from zerotrain.X import name` a submodule or a name X binds."""
    modules = project_modules()
    bound = {}
    stale = []
    for where, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                stale += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                          if a.name.split(".")[0] == "zerotrain" and a.name not in modules]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "zerotrain":
                if node.module not in modules:
                    stale.append(f"{where}:{node.lineno}: from {node.module}: no such module")
                    continue
                if node.module not in bound:
                    bound[node.module] = _bound_names(modules[node.module])
                stale += [f"{where}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if a.name != "*" and f"{node.module}.{a.name}" not in modules
                          and a.name not in bound[node.module]]
    assert not stale, "imports of names that are not there (moved?):\n" + "\n".join(stale)


LIGHT = r"""
import json, sys
from pathlib import Path
import zerotrain.launcher.commands.params, zerotrain.launcher.commands.plan, zerotrain.launcher.commands.profiles
import zerotrain.launcher.commands.report, zerotrain.launcher.cli
from zerotrain.launcher import cli
run = Path(sys.argv[1])
run.mkdir()
(run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s, "lr": 1e-3, "tokens_seen": 128 * s,
                                                       "tokens_per_s": 1000.0, "elapsed_s": s}) + "\n"
                                           for s in (1, 2, 3)))
for argv in (["--help"], ["profiles"], ["params"], ["params", "debug", "--optimizer", "muon"],
             ["plan", "--model", "tiny", "--gpus", "8", "--gpu-mem", "80"], ["runs", str(run.parent)],
             ["report", str(run)], ["launch", "--help"], ["slurm", "--help"]):
    try:
        cli.main(argv)
    except SystemExit as e:  # a command's --help exits 0
        assert e.code in (0, None), (argv, e.code)
heavy = sorted(m for m in ("torch", "deepspeed", "transformers", "datasets") if m in sys.modules)
print("HEAVY " + json.dumps(heavy))
"""


@pytest.mark.launches
def test_light_commands_never_import_torch(tmp_path):
    """`zerotrain --help`, profiles, params, plan, runs and report run without torch or deepspeed being
    imported (each would add seconds): one process runs them all, then looks at sys.modules. So do the modules
    of `zerotrain launch` and `zerotrain slurm`, which start every job (run_plan, which imports torch, only at the
    first restart: launch.restart_run_dir)."""
    r = subprocess.run([sys.executable, "-c", LIGHT, str(tmp_path / "run")], capture_output=True, text=True,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    heavy = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("HEAVY "))[len("HEAVY "):])
    assert heavy == [], f"a light command imported {heavy}"
    assert "tiny" in r.stdout and "cpu" in r.stdout and (tmp_path / "run" / "report").is_dir()


def test_docs_layout_names_every_module():
    """docs/layout.md is where a newcomer finds a module: every module file and every sub-package of the project
    is named there (by its file or folder name, as a word)."""
    text = (REPO / "docs" / "layout.md").read_text()
    block = text[text.index("# Layout"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    words = set(re.findall(r"[\w.]+", block))
    missing = []
    for module, path in project_modules().items():
        name = path.parent.name if path.name == "__init__.py" else path.stem
        if name not in words and f"{name}.py" not in words:
            missing.append(f"{path.relative_to(REPO)} ({module})")
    assert not missing, "modules docs/layout.md does not name: " + ", ".join(missing)


def test_the_trainer_reads_as_short_functions_and_names_no_monitor():
    """trainer.py stays a list of calls: no function's body (its docstring aside) over 45 lines, the loop
    about 25; and it names no monitor of the step: those are components/participants/ modules, listed in
    participants.ORDER (adding one does not edit the trainer)."""
    path = REPO / "launcher" / "trainer.py"
    tree = ast.parse(path.read_text())
    long = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
            lines = node.end_lineno - body[0].lineno + 1
            if lines > (25 if node.name == "_loop" else 45):
                long.append(f"launcher/trainer.py:{node.lineno} {node.name}: {lines} lines")
    assert not long, "functions too long to read at a glance (split them):\n" + "\n".join(long)
    modules = project_modules()
    named = sorted({t for t, _ in imports_of("zerotrain.launcher.trainer", path, modules)
                    if t.startswith("zerotrain.launcher.components.participants.")
                    and t != "zerotrain.launcher.components.participants.base"})
    assert not named, f"the trainer imports monitors by name ({', '.join(named)}): list them in participants.ORDER"
