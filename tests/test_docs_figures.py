"""Every measured speed a newcomer reads in README.md or docs/ is one benchmarks/RESULTS.md records.

RESULTS.md holds each measurement with the command, host and date that produced it; README and docs quote
them. This test finds, in the prose and tables of README.md and docs/*.md (not in fenced blocks, which hold
example output and commands), every

- throughput: a number followed by `tokens/s` or `tok/s` (`52,100 tokens/s`, `52.1k tokens/s`, `31.5M tok/s`);
- MFU: `52.7% MFU`, `MFU 52.7%`, `MFU 0.19`, `MFU 0.16-0.20`;
- GPU test count: `6 passed`;

and checks that RESULTS.md has the same figure (to the precision the doc writes it: `52,100` is 52,095 rounded,
`MFU 0.19` is 19.1%) on a line, or in a table, that speaks of the same quantity. A figure that is the
planner's output, not a measurement, says so in its sentence or table row (`planned`, `plan`, `planner`,
`expected`, `assumed`; a table row's header counts), and is skipped. Planner output a page shows (docs/planning.md,
docs/offload.md) is checked against what `zerotrain plan` prints today for the command the page names, in this
process. No process is started.
"""
from __future__ import annotations

import re
from decimal import Decimal

import pytest

from conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RESULTS = REPO / "benchmarks" / "RESULTS.md"

NUMBER = r"\d[\d,]*(?:\.\d+)?"
THROUGHPUT = re.compile(rf"({NUMBER})([kMG]?)\s?(?:tokens|tok)/s")
MFU_AFTER = re.compile(rf"(?<![\w.])({NUMBER})(%?)(?:\s?[-–]\s?({NUMBER})(%?))?\s?MFU")
MFU_BEFORE = re.compile(rf"MFU (?:of )?({NUMBER})(%?)(?:\s?[-–]\s?({NUMBER})(%?))?")
PASSED = re.compile(r"(\d+) passed")
PLANNED = re.compile(r"\bplan(?:ned|s|ner|ner's)?\b|\bexpected|\bassum", re.I)


def prose_units(text: str) -> list[str]:
    """The text outside fenced blocks, cut into sentences and table rows (each with its table's header row):
    a figure's context."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    units = []
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("|"):
            header, *rows = paragraph.strip().splitlines()
            units += [header + " " + row for row in rows]
        else:
            units += re.split(r"(?<=[.;])\s+(?=[A-Z*(])", " ".join(paragraph.split()))
    return units


def value(text: str, k: str = "") -> tuple[Decimal, Decimal]:
    """A written figure and half its last significant digit: `52,100` -> (52100, 50), `0.19` -> (0.19, 0.005)."""
    digits = text.replace(",", "")
    scale = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9}[k]
    number = Decimal(digits) * scale
    if "." in digits:
        unit = Decimal(1).scaleb(-len(digits.split(".")[1]))
    else:
        unit = Decimal(10) ** (len(digits) - len(digits.rstrip("0"))) if digits.strip("0") else Decimal(1)
    return number, unit * scale / 2


def as_percent(text: str, percent: str) -> tuple[Decimal, Decimal]:
    number, half = value(text)
    return (number, half) if percent or number > 1 else (number * 100, half * 100)


def numbers(text: str) -> list[Decimal]:
    return [value(n, k)[0] for n, k in re.findall(rf"({NUMBER})((?:[kMG](?![A-Za-z]))?)", text)]


def results_numbers() -> dict[str, list[Decimal]]:
    """RESULTS.md's figures by quantity: in a table, the cells of a column whose header (or the cell itself)
    names the quantity; in prose, the numbers of a line that names it (MFU: those written as percentages)."""
    found = {"throughput": [], "mfu": [], "passed": []}
    header: list[str] = []
    for line in RESULTS.read_text().splitlines():
        found["passed"] += [Decimal(n) for n in PASSED.findall(line)]
        if not line.startswith("|"):
            header = []
            if re.search(r"tokens/s|tok/s", line):
                found["throughput"] += numbers(line)
            if "MFU" in line:
                found["mfu"] += numbers(" ".join(re.findall(rf"{NUMBER}(?:[-–]{NUMBER})?%", line)))
            continue
        cells = line.strip().strip("|").split("|")
        if not header:
            header = cells
            continue
        for title, cell in zip(header, cells):
            if re.search(r"tokens/s|tok/s", title + cell):
                found["throughput"] += numbers(cell)
            if "MFU" in title + cell:
                found["mfu"] += numbers(" ".join(re.findall(rf"{NUMBER}(?:[-–]{NUMBER})?%", cell)))
    return found


def quoted_figures(text: str) -> list[tuple[str, str, Decimal, Decimal]]:
    """(quantity, as written, value, half its precision) of every measured figure in a page's prose."""
    figures = []
    for unit in prose_units(text):
        if PLANNED.search(unit):
            continue
        for m in THROUGHPUT.finditer(unit):
            figures.append(("throughput", m.group(0), *value(m.group(1), m.group(2))))
        for pattern in (MFU_AFTER, MFU_BEFORE):
            for m in pattern.finditer(unit):
                for number, percent in ((m.group(1), m.group(2)), (m.group(3), m.group(4) or m.group(2))):
                    if number:
                        figures.append(("mfu", m.group(0), *as_percent(number, percent)))
        for m in PASSED.finditer(unit):
            figures.append(("passed", m.group(0), Decimal(m.group(1)), Decimal(0)))
    return figures


def unrecorded(text: str, recorded: dict[str, list[Decimal]]) -> list[str]:
    return [written for quantity, written, number, half in quoted_figures(text)
            if not any(abs(r - number) <= half for r in recorded[quantity])]


def test_every_measured_figure_in_the_docs_is_in_results():
    recorded = results_numbers()
    missing = [f"{page.relative_to(REPO)}: {written}"
               for page in PAGES for written in unrecorded(page.read_text(), recorded)]
    assert not missing, "figures benchmarks/RESULTS.md does not record:\n" + "\n".join(missing)


@pytest.mark.parametrize("text, missing", [
    ("On one H200 the driver runs at **52,100 tokens/s, 52.7% MFU**.", []),
    ("One H100 at ZeRO-3 ran at MFU 0.16-0.20.", []),
    ("The GPU tier: 6 passed in 161 s.", []),
    ("On one H200 the driver runs at 61,000 tokens/s.", ["61,000 tokens/s"]),
    ("The loader from shards: 37.5M tokens/s.", ["37.5M tokens/s"]),
    ("The loader from shards: 54.2M tokens/s.", []),
    ("One H100 at ZeRO-3 ran at MFU 0.61.", ["MFU 0.61"]),
    ("The GPU tier: 9 passed.", ["9 passed"]),
    ("The recipe: 112,000 tokens/s (planned, MFU 0.45).", []),
    ("```\nrehearsal 20 steps: 5.0k tok/s\n```", []),
])
def test_an_unrecorded_figure_is_found(text, missing):
    assert unrecorded(text, results_numbers()) == missing


# A planner figure a page shows as output is what `zerotrain plan` prints today for the command the page names.
PLAN_EXAMPLES = [
    ("docs/planning.md", "zerotrain plan --profile h100-pcie-80g-x8 --depth 64 --vocab-size 32 --seq-len 2048"
                         " --micro-batch 4 --grad-accum 1 --zero 0 --max-hours 31 --budget-usd 1000 --gpu-hour-usd 4.03"),
    ("docs/offload.md", "zerotrain plan --config recipes/rtx6000ada-x2-7b-offload.json"),
]


@pytest.mark.parametrize("page, command", PLAN_EXAMPLES)
def test_a_pages_plan_output_is_what_the_planner_prints_today(page, command, capsys, monkeypatch):
    from zerotrain.launcher.commands.plan import plan_main

    text = (REPO / page).read_text()
    assert " ".join(command.split()[2:4]) in " ".join(text.replace("\\\n", " ").split()), f"{page} names {command}"
    at = text.index(command.split()[3])
    shown = next(m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
                 if m.start() > at and not m.group(1)).splitlines()  # the first plain fenced block after the command
    monkeypatch.chdir(REPO)
    plan_main(command.split()[2:])
    printed = capsys.readouterr().out.splitlines()
    stale = [line for line in shown if line.strip() and line not in printed]
    assert not stale, f"{page}: lines `{command}` no longer prints:\n" + "\n".join(stale)
