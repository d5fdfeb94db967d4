"""`make demo`: a real 2-rank DeepSpeed run on this machine, on text every Python install has.

Two sources, mixed by token share, written under runs/demo-data/ (nothing downloaded, nothing
committed from elsewhere):
- `docs` (70%): English prose from the interpreter's own documentation: the `pydoc` help topics
  and the docstrings of the standard library's modules, classes and functions (jsonl);
- `code` (30%): the standard library's Python source, one document per blank-line-separated
  block (txt).
"""
from __future__ import annotations

import ast
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

from zerotrain.cli_args import Parser
from zerotrain.launcher.components.launching.jobs import deepspeed_command, run_preserving_exit_code
from zerotrain.launcher.components.launching.ports import rendezvous_port

DEMO_FLAGS = ["--profile", "cpu", "--model", "debug", "--seq-len", "256", "--micro-batch", "8",
              "--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "20", "--max-steps", "400",
              "--save-every-steps", "200"]


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def build_demo_data(out: Path) -> Path:
    """Write docs.jsonl, code.txt and mix.json under `out`; returns the mix path."""
    out.mkdir(parents=True, exist_ok=True)
    mix = out / "mix.json"
    if mix.is_file():
        return mix
    from pydoc_data.topics import topics

    docs = [text.strip() for text in topics.values() if text.strip()]
    code_blocks = []
    for path in stdlib_files():
        source = path.read_text(encoding="utf-8", errors="replace")
        code_blocks.append(source)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    docs.append(doc)
    with open(out / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    (out / "code.txt").write_text("\n\n".join(code_blocks))
    mix.write_text(json.dumps({"sources": [
        {"name": "docs", "path": "docs.jsonl", "weight": 0.7},
        {"name": "code", "path": "code.txt", "weight": 0.3, "sample_by": "paragraph"}]}, indent=2) + "\n")
    return mix


def main(argv: list[str]) -> None:
    p = Parser(prog="zerotrain demo", allow_abbrev=False, usage="%(prog)s [-h] [train flags]",
               description="Write the offline demo mix (Python's own docs and standard library) under"
                           " $ZEROTRAIN_DEMO_DIR/demo-data (default runs/) and train the debug model for 400 steps on"
                           " 2 CPU ranks under DeepSpeed (the settings of the cpu-debug recipe).",
               epilog="Any other flags go to zerotrain train after these and override them (see its --help),"
                      " e.g. zerotrain demo --max-steps 50.")
    p.parse_known_args(argv)  # -h/--help: the usage, exit 0, nothing written or started
    out = Path(os.environ.get("ZEROTRAIN_DEMO_DIR", "runs"))
    mix = build_demo_data(out / "demo-data")
    run_id = "demo-" + time.strftime("%Y%m%d-%H%M%S")  # a fresh run each time; earlier ones are kept
    port, port_line = rendezvous_port(None)  # 29500, or a free one when another job holds it
    print(port_line, flush=True)
    cmd = deepspeed_command(2, ["--data", str(mix), "--out", str(out), "--run-id", run_id, *DEMO_FLAGS, *argv], port)
    print("+", " ".join(cmd), flush=True)
    sys.exit(run_preserving_exit_code(cmd))
