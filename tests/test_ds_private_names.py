"""Every DeepSpeed name that is not its public API is touched in launcher/components/ds_compat/ (each part listing
the names it touches in its own NAMES), or in a module its
ELSEWHERE names (zerotrain/ds_attributes.py, for the layers that may not import ds_compat) and only for the names
listed there; each of those is in ds_compat.PRIVATE_NAMES, so `check_deepspeed_version` looks it up.

The private names are read from the code and from DeepSpeed itself: the `_`-prefixed names PRIVATE_NAMES lists,
the attributes its source probes assign (`self.reduce_scatter = ...`), ds_compat.OFFLOADED_STATE, and every
`param.ds_*` attribute the installed DeepSpeed's zero.Init sets (partition_parameters.py). The walk (an AST, so
comments and docstrings may name them) flags an attribute read, a getattr/hasattr/setattr of one by name, and an
import of a `_`-prefixed name from deepspeed, in the package and benchmarks/. Starts no process.
"""
from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from zerotrain.launcher.components import ds_compat

REPO = Path(__file__).resolve().parent.parent
SCANNED = ("launcher", "modeling", "dataio", "zerotrain", "benchmarks")
OWNER = "launcher/components/ds_compat/"
ACCESSORS = ("ds_compat", "ds_attributes")  # `ds_attributes.basic_optimizer(engine)` is the accessor, not a touch


def private_names() -> set[str]:
    names = set(ds_compat.OFFLOADED_STATE)
    for entry in ds_compat.PRIVATE_NAMES:
        names |= {p for p in entry.name.split(".") if p.startswith("_") and not p.startswith("__")}
        names |= set(re.findall(r"(?:self|param)\.(\w+) =", entry.source_has))
    zero_init = Path(importlib.util.find_spec("deepspeed.runtime.zero.partition_parameters").origin).read_text()
    return names | set(re.findall(r"param\.(ds_\w+) =", zero_init))


def touches(path: Path, names: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in names
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", *ACCESSORS))):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("_")]
    return found


def test_the_probe_knows_the_names_in_the_issue():
    names = private_names()
    assert {"_SEQUENCE_PARALLEL_GROUP", "all2all_process_group", "ds_id", "ds_tensor", "ds_shape", "ds_status",
            "basic_optimizer", "_copy_recovery_script"} <= names, sorted(names)


def test_no_deepspeed_private_name_outside_ds_compat():
    names = private_names()
    stray = []
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel.startswith(OWNER):
                continue
            allowed = set(ds_compat.ELSEWHERE.get(rel, ()))
            stray += [f"{rel}:{line}: {name}" for line, name in touches(path, names) if name not in allowed]
    assert not stray, ("DeepSpeed private names outside launcher/components/ds_compat/ (route them through an"
                       " accessor there, or in zerotrain/ds_attributes.py listed in ds_compat.ELSEWHERE, with a"
                       " PRIVATE_NAMES entry):\n" + "\n".join(stray))


def test_every_name_read_elsewhere_is_listed_with_its_version_check():
    probed = {m for e in ds_compat.PRIVATE_NAMES for m in re.findall(r"(?:self|param)\.(\w+) =", e.source_has)}
    for rel, names in ds_compat.ELSEWHERE.items():
        assert (REPO / rel).is_file(), rel
        assert set(names) <= probed, f"{rel}: {sorted(set(names) - probed)} not in ds_compat.PRIVATE_NAMES"
        assert {name for _, name in touches(REPO / rel, private_names())} == set(names), rel


def test_each_ds_compat_part_lists_the_names_it_touches():
    """A name touched in ds_compat/<part>.py is in that part's own NAMES (or its OFFLOADED_STATE), so each part
    carries its own version check; the parts' NAMES are all of PRIVATE_NAMES."""
    assert ds_compat.PRIVATE_NAMES == tuple(e for part in ds_compat.PARTS for e in part.NAMES)
    every = private_names()
    for part in ds_compat.PARTS:
        own = set(getattr(part, "OFFLOADED_STATE", ()))
        for entry in part.NAMES:
            own |= {p for p in entry.name.split(".") if p.startswith("_") and not p.startswith("__")}
            own |= set(re.findall(r"(?:self|param)\.(\w+) =", entry.source_has))
            own |= {name for name in every if re.search(rf"\b{name}\b", entry.source_has)}  # its check reads it
        path = Path(part.__file__)
        stray = sorted({name for _, name in touches(path, every)} - own)
        assert not stray, f"{path.name} touches {stray} without listing them in its NAMES"
