"""Rules the code keeps, read from the source (AST and text, nothing run): each guards a leftover that was
cleaned up from coming back.

- DeepSpeed's shared-memory buffer name is spelled in launcher/components/ds_compat/launching.py only (tests and
  benchmarks list leaked buffers with `ds_compat.allreduce_buffer_files`).
- One way to pick a free port (`launching.ports.free_port`), not a socket snippet per file.
- Comments and docstrings say what they mean, never "issue N" (DeepSpeed's own issues, "#N", may be cited).
- No module of the project imports another's `_private` name: a name two modules share is public.
- A module that loads torch when imported does not import torch again inside a function: imports stand at
  the top, in-function only where they are heavy and optional.
"""
from __future__ import annotations

import ast
import re
import sys

from test_architecture import REPO, _resolve, _sources, project_modules

DS_COMPAT = "launcher/components/ds_compat/launching.py"
PORTS = "launcher/components/launching/ports.py"
# What `import torch` loads itself (checked below): importing one of these again in a function is free and
# only hides the dependency. Submodules torch loads on first use (torch._dynamo, the varlen kernel) may be
# imported where they are used.
TORCH_CORE = ("torch", "torch.distributed", "torch.serialization", "torch.optim", "torch.optim.lr_scheduler",
              "torch.nn", "torch.nn.functional", "torch.utils.data")


def test_the_shm_buffer_name_is_spelled_in_ds_compat_only():
    name = "deepspeed_allreduce" + "_buffer"  # spelled in two halves: this file is a source too
    bad = [where for where, text in _sources() if name in text and where != DS_COMPAT]
    assert not bad, f"DeepSpeed's shm buffer name outside {DS_COMPAT} (use ds_compat.allreduce_buffer_files): {bad}"


def test_one_free_port_helper():
    snippet = re.compile(r"with socket\.socket\(\) as (\w+):\s*\n\s*\1\.bind\(")
    bad = [where for where, text in _sources() if snippet.search(text) and where != PORTS]
    assert not bad, f"a free-port snippet of its own (use {PORTS}'s free_port): {bad}"


def test_no_issue_numbers_in_the_code():
    texts = _sources() + [(name, (REPO / name).read_text()) for name in ("setup.cfg", "Makefile")]
    bad = [f"{where}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for where, text in texts
           for m in re.finditer(r"\b[Ii]ssues? \d+", text)]
    assert not bad, "comments that cite a project issue instead of saying what they mean:\n" + "\n".join(bad)


def test_no_private_name_is_imported_across_modules():
    bad = []
    for module, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerotrain"):
                bad += [f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {a.name}"
                        for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "private names imported by another module (make them public):\n" + "\n".join(bad)


def _top_imports(path) -> set[str]:
    """Every module a file imports at module level (inside if/try too, not under TYPE_CHECKING)."""
    out, todo = set(), list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.dump(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def test_no_in_function_import_of_torch_where_the_module_loads_it():
    import torch  # noqa: F401  (the list above is what it loads)
    assert all(m in sys.modules for m in TORCH_CORE), [m for m in TORCH_CORE if m not in sys.modules]
    modules = project_modules()
    tops = {m: _top_imports(p) for m, p in modules.items()}

    def loads_torch(module: str, seen: set) -> bool:
        seen.add(module)
        for name in tops[module]:
            if name.split(".")[0] == "torch":
                return True
            target = _resolve(name, modules) if name.split(".")[0] == "zerotrain" else None
            if target and target not in seen and loads_torch(target, seen):
                return True
        return False

    bad = []
    for module, path in modules.items():
        if not loads_torch(module, set()):
            continue
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                bad += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n in TORCH_CORE]
    assert not bad, ("in-function imports of torch in modules that load torch anyway (import it at the top):\n"
                     + "\n".join(sorted(set(bad))))


def test_no_undefined_name_in_the_package():
    """A name used and never bound (a function moved to another module without its imports): pyflakes' check,
    which the interpreter only makes when the line runs (report's health row was one such, found by a launch)."""
    from pyflakes.api import checkPath
    from pyflakes.reporter import Reporter

    class Undefined(Reporter):
        def __init__(self):
            self.found = []

        def flake(self, message):
            if type(message).__name__ in ("UndefinedName", "UndefinedExport", "UndefinedLocal"):
                self.found.append(str(message))

        def unexpectedError(self, filename, msg):
            self.found.append(f"{filename}: {msg}")

        def syntaxError(self, filename, msg, lineno, offset, text):
            self.found.append(f"{filename}:{lineno}: {msg}")

    reporter = Undefined()
    for folder in ("launcher", "modeling", "dataio", "zerotrain", "benchmarks"):
        for path in sorted((REPO / folder).rglob("*.py")):
            checkPath(str(path), reporter)
    assert not reporter.found, "\n".join(reporter.found)
