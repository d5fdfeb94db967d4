"""Every torch name outside its public API (torch._dynamo, torch._higher_order_ops, torch._C, torch.distributed._*)
is reached in zerotrain/torch_private.py only, and each it lists is in the installed torch. An AST walk of the
package (comments and docstrings may name them; benchmarks/peer_loops.py copies other projects' loops as they are
written, torch._foreach_copy_ included) flags `torch._x...` and `torch.a._x` attribute
chains and imports of such modules or `_`-prefixed names from torch. Starts no process."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

from zerotrain import torch_private

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("launcher", "modeling", "dataio", "zerotrain")
OWNER = "zerotrain/torch_private.py"


def private(parts: list[str]) -> bool:
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def touches(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            parts, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                parts.insert(0, value.attr)
                value = value.value
            if isinstance(value, ast.Name) and private([value.id, *parts]):
                found.append((node.lineno, ".".join([value.id, *parts])))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if private(a.name.split("."))]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if private([*node.module.split("."), a.name])]
    return found


def test_every_listed_torch_name_is_in_the_installed_torch():
    for module, name in torch_private.PRIVATE_NAMES:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)


def test_no_torch_private_name_outside_torch_private():
    stray = set()
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel != OWNER:
                stray |= {f"{rel}:{line}: {name}" for line, name in touches(path)}
    assert not stray, (f"torch private names outside {OWNER} (add an accessor there and list it in PRIVATE_NAMES):\n"
                       + "\n".join(sorted(stray)))


def test_the_walk_sees_what_torch_private_reaches():
    assert {name for _, name in touches(REPO / OWNER)} >= {"torch._dynamo.maybe_mark_dynamic",
                                                           "torch._dynamo.utils.counters"}
