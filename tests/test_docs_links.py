"""What README.md and docs/ point a newcomer at exists: every section they name, every flag they type.

- a link with an anchor (`[x](docs/data.md#packing)`) names a heading of its target, and a quoted section
  (`README "Exit codes"`, `docs/models.md, "Hugging Face export and import"`, the style of the `--help` texts,
  which docs/cli.md holds) names (a part of) a heading of that page;
- every `zerotrain COMMAND ...` line in a fenced code block, and every inline `zerotrain COMMAND ...`, uses only
  flags that COMMAND's `--help` lists (read from docs/cli.md, which tests/test_docs.py keeps equal to `--help`;
  the train flags after `launch ... --` and those `plan`, `preflight` and `demo` pass on are train's).
No process is started.
"""
from __future__ import annotations

import re
import shlex

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.M)
ANCHOR_LINK = re.compile(r"\]\(([^)#\s]*\.md)#([^)\s]+)\)")
# README "Section", docs/data.md "Section", models.md, "Section", README ["Section"](...), RESULTS.md "Section"
QUOTED = re.compile(r"(?<![\w/.-])((?:\.\./)?README(?:\.md)?|(?:(?:\.\./)?(?:docs|benchmarks)/)?[\w-]+\.md)`?[)\]]?,?"
                    r" \[?\"([^\"]{3,80})\"")
SEE = re.compile(r'\bsee "([^"]{3,80})"')  # a section of the same page
FLAG = re.compile(r"^--?[A-Za-z][\w-]*$")
TRAIN_FLAGS_TOO = {"launch", "slurm", "plan", "preflight", "demo"}


def page_file(name: str, page) -> object:
    name = name.removeprefix("../")
    if name.startswith("README"):
        return REPO / "README.md"
    for candidate in (REPO / name, REPO / "docs" / name, REPO / "benchmarks" / name, page.parent / name):
        if candidate.is_file():
            return candidate
    return None


def headings(path) -> list[str]:
    return [h.replace("`", "").strip() for h in HEADING.findall(strip_code(path.read_text()))]


def strip_code(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_every_section_a_page_names_exists():
    dead = []
    for page in PAGES:
        text = page.read_text()
        for target, anchor in ANCHOR_LINK.findall(text):
            path = (page.parent / target) if target else page
            if path.is_file() and anchor not in {slug(h) for h in headings(path)}:
                dead.append(f"{page.relative_to(REPO)}: {target}#{anchor}")
        for name, section in QUOTED.findall(text):
            path = page_file(name, page)
            if path is None:
                dead.append(f"{page.relative_to(REPO)}: {name} (no such page)")
            elif not any(" ".join(section.lower().rstrip(".").split()) in h.lower() for h in headings(path)):
                dead.append(f"{page.relative_to(REPO)}: {name} \"{section}\"")
        for section in SEE.findall(text):
            if not any(" ".join(section.lower().split()) in h.lower() for h in headings(page)):
                dead.append(f"{page.relative_to(REPO)}: see \"{section}\"")
    assert not dead, "sections named that do not exist: " + "; ".join(dead)


def help_flags() -> dict[str, set[str]]:
    """command -> the flags its `--help` lists (docs/cli.md's section `## zerotrain COMMAND`)."""
    text = (REPO / "docs" / "cli.md").read_text()
    flags = {}
    for m in re.finditer(r"^## zerotrain ([\w -]+)\n\n```\n(.*?)^```", text, re.S | re.M):
        help_text = m.group(2)
        listed = [help_text.split("\n\n")[0]]  # the usage lines
        listed += re.findall(r"^ {2}(-\S.*?)(?: {2,}|$)", help_text, re.M)  # each option's own names
        listed += re.findall(r"^deepspeed flags: .*?(?:\n\n|\Z)", help_text, re.S | re.M)  # launch passes these on
        flags[m.group(1).strip()] = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", " ".join(listed)))
    return flags


def command_lines(text: str) -> list[str]:
    lines = []
    for block in re.findall(r"^```[\w-]*\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("zerotrain "):
                lines.append(line)
    lines += [m for m in re.findall(r"`(zerotrain [^`]+)`", strip_code(text))]
    return lines


def unknown_flags(line: str, flags: dict[str, set[str]]) -> list[str]:
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        words = line.split()
    words = words[1:]
    words = words[:next((i for i, w in enumerate(words) if w in ("|", "||", "&&", ";", ">", "2>&1")), len(words))]
    if not words or words[0] not in flags:
        return []
    command = words[0]
    if command == "tokenizer" and words[1:2] == ["train"]:
        command, words = "tokenizer train", words[1:]
    own, train = flags.get(command, set()), flags["train"]
    bad, after_dashes = [], False
    for word in words[1:]:
        if word == "--":
            after_dashes = True
            continue
        name = word.split("=")[0]
        if not FLAG.match(name) or name.isupper() or name.lstrip("-").isupper():
            continue  # a value, a placeholder (TRAIN-FLAGS, FLAGS, ...) or a negative number
        allowed = train if after_dashes else own | (train if command in TRAIN_FLAGS_TOO else set())
        if name not in allowed:
            bad.append(name)
    return bad


def test_every_zerotrain_command_line_uses_flags_its_help_lists():
    flags = help_flags()
    assert {"train", "launch", "plan", "tokenizer train"} <= set(flags), sorted(flags)
    wrong = []
    for page in PAGES:
        for line in command_lines(page.read_text()):
            bad = unknown_flags(line, flags)
            if bad:
                wrong.append(f"{page.relative_to(REPO)}: `{line}` ({', '.join(bad)})")
    assert not wrong, "flags no --help lists:\n" + "\n".join(wrong)


@pytest.mark.parametrize("line, bad", [
    ("zerotrain train --profile cpu --dta mix.json", ["--dta"]),
    ("zerotrain launch -n 2 --max-restart 3 -- --profile cpu", ["--max-restart"]),
    ("zerotrain launch -n 2 -- --max-restarts 3", ["--max-restarts"]),
    ("zerotrain tokenizer train --data m.json --vocab-size 300 --out t/", []),
    ("zerotrain plan --gpus 8 --profile a100-80g-x8 --data mix.json", []),
])
def test_a_misspelled_or_misplaced_flag_is_found(line, bad):
    assert unknown_flags(line, help_flags()) == bad


def test_a_dead_section_is_found(tmp_path):
    assert QUOTED.findall('see README "Exit codes" and docs/models.md, "Hugging Face export"') == [
        ("README", "Exit codes"), ("docs/models.md", "Hugging Face export")]
    assert not any("exit codes" in h.lower() for h in headings(REPO / "README.md"))
    assert SEE.findall('(see "Optimizers")') == ["Optimizers"]
    assert slug("Hugging Face export and import") == "hugging-face-export-and-import"


def test_help_says_which_flags_are_required():
    train = (REPO / "docs" / "cli.md").read_text().split("## zerotrain train", 1)[1].split("## zerotrain launch")[0]
    data = train[train.index("  --data DATA"):].split("\n  --")[0]
    assert "(required" in data, data
