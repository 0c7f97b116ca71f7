"""Every figure quoted in README.md, docs/*.md and benches/NOTES.md comes from a record the bench
tool wrote under benches/results/, or is listed in benches/figures.toml with the reason it is not
(yet) one. The rules (also at the top of benches/figures.toml):

* a *record* is a JSON file under benches/results/ with the fields the bench tool writes
  (``benchmark``, ``method``, ``env.date``, ``env.host``, ``env.mori_version``); any other JSON
  there is hand-written and must be listed as such in figures.toml;
* a *figure* is a number in a table's data cell of figures (not the first column, which names
  the row), or a number in prose (or a table cell of text) followed by a unit of measure (µs,
  ms, s, GB/s, %, ×, ops/s, ...), also through lists such as "4.57 / 5.00 µs" or "332–360 GB/s";
  sizes (KiB, MiB, ...), targets and bounds (after ≥, ≤, <, >, "within"), noise (±), dates,
  versions and anything in `code` are not figures;
* a figure's *sources* are the records (``results/<name>.json``) its paragraph or table row
  names, else those its section or the sections above it name, else every record of the
  benchmark the document is about (docs/<benchmark>.md, NOTES.md's ## section); the README's
  may come from any record; a record's settings, targets and copied constants are not sources,
  nor is a record of ranks sharing GPUs (``config.gpus_shared``: correctness evidence, its times
  are not comparable);
* rounding: a figure written with d decimals matches a record value v when
  |v × scale − figure| ≤ 0.5 × 10^-d for one of the unit scales 1, 10^±3, 10^±6, 100.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading benches/figures.toml needs Python >= 3.11")

ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benches" / "results"
ALLOW = ROOT / "benches" / "figures.toml"
DOCUMENTS = [ROOT / "README.md", ROOT / "benches" / "NOTES.md", *sorted((ROOT / "docs").glob("*.md"))]
SCALES = (1.0, 1e3, 1e-3, 1e6, 1e-6, 100.0)
# Record fields that hold no measurement: the run's settings, the targets, and the
# DeepEP figures old records copied from a constant.
NOT_MEASURED = {"config", "env", "method", "targets", "target_gbps", "deepep_baseline_us"}
TOOL_FIELDS = ("benchmark", "method")
TOOL_ENV_FIELDS = ("date", "host", "mori_version")

NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:[  ]\d{3})+(?![\d.])|(?<![\w.])\d+(?:\.\d+)?(?![\w.])")
# Between the numbers of one list ("4.57 / 5.00 µs", "332–360 GB/s", "4.8, 5.4 and 18.3 µs").
SEPARATOR = re.compile(r"\s*(?:/|–|-|,|and|or|to|vs\.?)\s*")
UNIT = re.compile(r"\s*(?:µs|us\b|ms\b|s\b|ns\b|GB/s|TB/s|MB/s|%|×(?!\s*\d|H)|x\b(?!\s*\d)|k ops/s|M key-ops/s|key-ops/s|ops/s|M\b|k\b)")
NOT_FIGURES = [
    re.compile(r"`[^`]*`"),  # code, commands, file names
    re.compile(r"\]\([^)]*\)"),  # link targets
    re.compile(r"\d{4}-\d{2}-\d{2}(?:T\w+)?"),  # dates and record stamps
    re.compile(r"\bv?\d+\.\d+\.\d+\w*"),  # versions
    re.compile(r"\b(?:NCCL|CUDA|torch|Python|Rust|kernel|driver|glibc|NVRTC|Triton|Debian)\s+\d+(?:\.\d+)*"),  # versions
    re.compile(r"\d+\s*×\s*(?=\d)"),  # shapes: 128 × 64 KiB
    re.compile(r"\b\d+×(?=H\d)"),  # 2×H200
    re.compile(r"\d+(?:\.\d+)?\s*(?:B|KiB|MiB|GiB|TiB|KB|MB|GB|bytes?)\b(?!/)"),  # sizes
    re.compile(r"(?:[≥≤<>]|\b(?:target|floor|at least|at most|within))\s*[^|;,)]*"),  # targets and bounds
    re.compile(r"±\s*\d+(?:\.\d+)?"),  # noise estimates
    re.compile(r"\b(?:EP|sm_|NV|SM|PE|GPU|rank|issue #)\s*\d+"),  # names with a number
]


@dataclass(frozen=True)
class Figure:
    document: str
    line: int
    section: str  # the heading path, "## a > ### b"
    text: str  # as written
    value: float
    decimals: int
    sources: tuple[str, ...]  # the records it may come from


def _clean(text: str) -> str:
    for pattern in NOT_FIGURES:
        text = pattern.sub(" ", text)
    return text


def _numbers(text: str) -> list[re.Match]:
    return list(NUMBER.finditer(text))


def _prose_figures(text: str) -> list[str]:
    """Numbers followed by a unit, directly or at the end of a list of numbers."""
    found = []
    matches = _numbers(text)
    for i, m in enumerate(matches):
        j, end = i, m.end()
        while True:
            if UNIT.match(text, end):
                found.append(m.group())
                break
            sep = SEPARATOR.match(text, end)
            if not sep or j + 1 >= len(matches) or matches[j + 1].start() != sep.end():
                break
            j += 1
            end = matches[j].end()
    return found


def _table_figures(line: str) -> list[str]:
    """A data row's figures: every number of a cell of figures (at most 20 letters besides them,
    e.g. "262.1 (0.96 × NCCL)"); in a cell of text (an API table's), those with a unit."""
    out = []
    for cell in line.strip().strip("|").split("|")[1:]:
        cell = _clean(cell)
        text = len(re.findall(r"[^\W\d_]", cell)) > 20
        out += _prose_figures(cell) if text else [m.group() for m in _numbers(cell)]
    return out


def _cited(text: str) -> set[str]:
    return set(re.findall(r"results/([\w.-]+\.json)", text))


def _kind(document: str, headings: list[tuple[int, str, set[str]]]) -> str | None:
    """The benchmark a text is about: docs/<kind>.md, or the first word of NOTES.md's ## heading."""
    if document.startswith("docs/"):
        return Path(document).stem
    top = [h for h in headings if h[0] == 2]
    return top[0][1].split()[0] if document == "benches/NOTES.md" and top else None


def figures(names: list[str]) -> list[Figure]:
    """Every figure of the documents, with its sources among the record ``names``: the records
    its paragraph or table row names, else those its sections name, else every record of its
    document's (or NOTES.md section's) benchmark; the README's, any record."""
    out = []
    for doc in DOCUMENTS:
        name = str(doc.relative_to(ROOT))
        lines = doc.read_text().splitlines()
        # (level, title, records its section names) of the headings above the current line
        headings: list[tuple[int, str, set[str]]] = []
        section_cites = _section_citations(lines)
        in_code = False
        for n, line in enumerate(lines):
            if line.startswith("```"):
                in_code = not in_code
            if in_code or line.startswith("```"):
                continue
            if line.startswith("#"):
                level = len(line) - len(line.lstrip("#"))
                headings = [h for h in headings if h[0] < level] + [(level, line.lstrip("# ").strip(), section_cites[n])]
                continue
            if line.startswith("|"):
                if re.fullmatch(r"\|[\s|:-]+\|?", line.strip()) or _is_header(lines, n):
                    continue
                texts, unit = _table_figures(line), line
            else:
                texts, unit = _prose_figures(_clean(line)), _paragraph(lines, n)
            kind = _kind(name, headings)
            sources = (_cited(unit) or {r for h in headings for r in h[2]}
                       or ({r for r in names if r.startswith(f"{kind}-")} if kind else set()))
            if name == "README.md":
                sources = set(names)
            section = " > ".join(h[1] for h in headings)
            for t in texts:
                plain = t.replace(" ", "").replace("\u202f", "")
                decimals = len(plain.split(".")[1]) if "." in plain else 0
                out.append(Figure(name, n + 1, section, t, float(plain), decimals, tuple(sorted(sources))))
    return out


def _section_citations(lines: list[str]) -> dict[int, set[str]]:
    """{heading line: records named between it and the next heading}."""
    cites: dict[int, set[str]] = {}
    current = None
    for n, line in enumerate(lines):
        if line.startswith("#"):
            current = n
            cites[n] = set()
        if current is not None:
            cites[current] |= _cited(line)
    return cites


def _paragraph(lines: list[str], n: int) -> str:
    """The prose paragraph around line n (between blank lines, headings and tables)."""
    def inside(i: int) -> bool:
        return 0 <= i < len(lines) and lines[i].strip() != "" and not lines[i].startswith(("#", "|", "```"))

    a = b = n
    while inside(a - 1):
        a -= 1
    while inside(b + 1):
        b += 1
    return "\n".join(lines[a : b + 1])


def _is_header(lines: list[str], n: int) -> bool:
    """A table's first row (the next line is the |---| separator)."""
    return n + 1 < len(lines) and re.fullmatch(r"\|[\s|:-]+\|?", lines[n + 1].strip()) is not None


def _leaves(obj) -> list[float]:
    """The measured numbers of a record: not its configuration, targets or copied constants."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [v for k, x in obj.items() if k not in NOT_MEASURED and not k.endswith("_target") for v in _leaves(x)]
    if isinstance(obj, list):
        return [v for x in obj for v in _leaves(x)]
    return []


def _is_tool_record(record: dict) -> bool:
    env = record.get("env")
    return all(k in record for k in TOOL_FIELDS) and isinstance(env, dict) and all(k in env for k in TOOL_ENV_FIELDS)


def records() -> tuple[dict[str, list[float]], set[str]]:
    """({tool-written record: its sorted numbers}, {hand-written records})."""
    tool, hand = {}, set()
    for path in sorted(RESULTS.glob("*.json")):
        record = json.loads(path.read_text())
        if _is_tool_record(record):
            shared = isinstance(record.get("config"), dict) and record["config"].get("gpus_shared")
            tool[path.name] = [] if shared else sorted(_leaves(record))
        else:
            hand.add(path.name)
    return tool, hand


def found_in(fig: Figure, values: list[float]) -> bool:
    tol = 0.5 * 10.0**-fig.decimals * (1 + 1e-9)
    for scale in SCALES:
        lo, hi = (fig.value - tol) / scale, (fig.value + tol) / scale
        i = bisect.bisect_left(values, lo)
        if i < len(values) and values[i] <= hi:
            return True
    return False


def allow_list() -> dict:
    return tomllib.loads(ALLOW.read_text())


def _allowed(fig: Figure, entry: dict) -> bool:
    if entry["document"] != fig.document or not fig.section.startswith(entry["section"]) and entry["section"] not in fig.section:
        return False
    return entry.get("values", "all") == "all" or fig.text in entry["values"]


def unsourced() -> tuple[list[Figure], list[dict]]:
    """(figures neither in a source record nor allow-listed, allow-list entries no figure needs)."""
    tool, hand = records()
    entries = allow_list().get("figure", [])
    used = [False] * len(entries)
    missing = []
    for fig in figures(sorted(tool) + sorted(hand)):
        pools = [tool[r] for r in fig.sources if r in tool]  # a hand-written record is no source
        if any(found_in(fig, values) for values in pools):
            continue
        hits = [i for i, e in enumerate(entries) if _allowed(fig, e)]
        for i in hits:
            used[i] = True
        if not hits:
            missing.append(fig)
    return missing, [e for e, u in zip(entries, used) if not u]


def test_every_quoted_figure_comes_from_a_record_or_is_listed_with_a_reason():
    missing, stale = unsourced()
    lines = [f"{f.document}:{f.line} [{f.section}]: {f.text} (sources: {', '.join(f.sources) or 'none'})" for f in missing]
    assert not lines, "figures found in no record and not in benches/figures.toml:\n  " + "\n  ".join(lines)
    assert not stale, f"benches/figures.toml lists figures no document quotes any more: {stale}"


def test_hand_written_records_are_listed_and_every_listed_one_exists():
    _, hand = records()
    listed = {e["record"]: e["reason"] for e in allow_list().get("hand_written", [])}
    assert hand == set(listed), f"records not written by the bench tool {sorted(hand)}; listed as such {sorted(listed)}"
    assert all(reason.strip() for reason in listed.values())


def test_every_allow_list_entry_says_why():
    for entry in allow_list().get("figure", []):
        assert entry.get("reason", "").strip(), entry
        assert (ROOT / entry["document"]).exists(), entry


@pytest.mark.parametrize("text,want", [
    ("Triton one-shot 4.57 / 5.00 / 5.27 µs at 8 KiB / 32 KiB", ["4.57", "5.00", "5.27"]),
    ("128 × 1 MiB at 332–360 GB/s on 2×H200", ["332", "360"]),
    ("1.6× DeepEP's dispatch at 24 SMs, NCCL 2.28, 83 % of raw", ["1.6", "83"]),
    ("a 10 000-block batch in 46 µs (target ≤ 100 µs)", ["46"]),
])
def test_figures_in_prose_are_numbers_with_a_unit(text, want):
    assert _prose_figures(_clean(text)) == want


def test_table_figures_skip_the_row_name_sizes_and_targets():
    assert _table_figures("| 128 × 64 KiB | ≥ 250 GB/s | 204 / 198 | **279** (`results/x-2026-11-30T1.json`) |") == ["204", "198", "279"]


def test_rounding_rule():
    fig = Figure("d", 1, "s", "202", 202.0, 0, ())
    assert found_in(fig, [201.6]) and found_in(fig, [0.0002024]) and not found_in(fig, [203.0])
    two = Figure("d", 1, "s", "4.04", 4.04, 2, ())
    assert found_in(two, [4.0449]) and not found_in(two, [4.046])
