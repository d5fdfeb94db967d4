"""The README is a short guide and docs/ the reference: both stay true to the code.

- the README stays a guide (at most 250 lines) and every relative link in it and in docs/ resolves;
- docs/cli.md is exactly what the commands' `--help` prints today (docs/generate_cli.py --check).
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_a_short_guide():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference material into docs/"


def test_every_relative_link_resolves():
    broken = []
    for page in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


@pytest.mark.launches
def test_cli_reference_is_current():
    proc = subprocess.run([sys.executable, str(REPO / "docs" / "generate_cli.py"), "--check"], capture_output=True,
                          text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr
