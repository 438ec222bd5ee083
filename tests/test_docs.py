"""The docs cite tests as the proof of each rule: every cited test exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _defined_tests() -> set[str]:
    defined = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        defined |= set(re.findall(r"^def (test_\w+)\(", path.read_text(), re.M))
    return defined


def _cited_tests(page: str) -> set[str]:
    spans = re.findall(r"`([^`]+)`", (ROOT / "docs" / page).read_text())
    return {name for span in spans for name in re.findall(r"\b(test_\w+)\b(?!\.py)", span)}


def test_every_test_cited_in_the_semantics_exists():
    cited = _cited_tests("semantics.md")
    assert len(cited) >= 20  # the page cites its proofs
    assert cited <= _defined_tests(), sorted(cited - _defined_tests())


def test_every_failure_in_the_reliability_page_cites_an_existing_test():
    cited = _cited_tests("reliability.md")
    text = (ROOT / "docs" / "reliability.md").read_text()
    rows = re.findall(r"^\| (\d+) \|.*$", text, re.M)
    assert sorted(map(int, rows)) == list(range(1, 11))  # the ten items of the issue
    rows = [r for r in text.splitlines() if re.match(r"\| \d+ \|", r)]
    assert all("`test_" in r for r in rows)  # each item names its test
    assert cited <= _defined_tests(), sorted(cited - _defined_tests())


def test_the_readme_python_tour_runs():
    """The README's Python snippets, run in order as one script, raise nothing."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    exec(compile("\n".join(blocks), "README.md", "exec"), {})  # noqa: S102
