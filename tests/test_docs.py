"""The docs cite tests as the proof of each rule: every cited test exists.

And the pages hold together: every relative link and image resolves, the README stays a front
page that opens with the set-up commands CI runs, and its Python tour (and the docs pages'
```python blocks) run. ```py blocks are shown, never run: they need a checkpoint or a package
the tests do not install.
"""

from __future__ import annotations

import re
from pathlib import Path

from printed import run_checked

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 350

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _test_files() -> list[Path]:
    # rglob: the tests may live in subfolders of tests/
    return sorted((ROOT / "tests").rglob("test_*.py"))


def _defined_in(path: Path) -> set[str]:
    return set(re.findall(r"^[ \t]*(?:async[ \t]+)?def (test_\w+)\(", path.read_text(), re.M))


def _defined_tests() -> set[str]:
    defined = set()
    for path in _test_files():
        defined |= _defined_in(path)
    return defined


def _cited_tests(page: str) -> set[str]:
    return _cited_in((DOCS / page).read_text())


def _cited_in(text: str) -> set[str]:
    spans = re.findall(r"`([^`]+)`", text)
    return {name for span in spans for name in re.findall(r"\b(test_\w+)\b(?!\.py)", span)}


def _pages() -> list[Path]:
    """The README and the docs pages, the generated reports under docs/ included."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _front_pages() -> list[Path]:
    """The README and the hand-written pages directly under docs/."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """The text outside code: fenced blocks and code spans blanked."""
    return CODE_SPAN.sub("``", FENCE.sub("", text))


def _relative_links(page: Path) -> list[str]:
    links = LINK.findall(_prose(page.read_text()))
    return [t for t in links if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]  # http, mailto...


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", FENCE.sub("", page.read_text()), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M)


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


def test_the_readme_python_tour_runs_and_prints_what_its_comments_say():
    """The README's Python snippets, run in order as one script, raise nothing, and each
    ``# -> EXPECTED`` comment holds (tests/printed.py): among them, an untrained model's loss
    near ln(vocab), which only targets shifted by one give (unshifted, it copies: ~2.6)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert len(blocks) >= 3
    assert run_checked("\n".join(blocks), "README.md") == []


def test_an_unshifted_target_breaks_the_tours_expectation():
    """The check has teeth: the tour's first snippet with ``targets=x`` fails its comment."""
    first = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    assert "targets=y" in first
    problems = run_checked(first.replace("targets=y", "targets=x"), "README.md")
    assert any("vs ln(vocab)" in p for p in problems), problems


def test_the_python_blocks_of_the_docs_pages_run():
    """Each docs page's ```python blocks, run in order as one script per page, raise nothing
    (and print what their ``# -> EXPECTED`` comments say, where they have some)."""
    ran = 0
    for page in sorted(DOCS.glob("*.md")):
        blocks = _python_blocks(page)
        if blocks:
            where = str(page.relative_to(ROOT))
            assert run_checked("\n".join(blocks), where, require=False) == []
            ran += 1
    assert ran >= 2  # the MoDE and KV pages show runnable code


def test_every_relative_link_and_image_points_to_an_existing_file():
    broken = []
    for page in _pages():
        for target in _relative_links(page):
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_link_to_a_heading_finds_it():
    """`page.md#anchor` and `#anchor` links name a heading that exists."""
    broken = []
    for page in _pages():
        for target in _relative_links(page):
            path, _, anchor = target.partition("#")
            if not anchor:
                continue
            dest = (page.parent / path) if path else page
            if dest.suffix == ".md" and dest.exists() and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_every_test_cited_in_the_readme_and_the_docs_pages_exists():
    """Test names (`test_x`, `test_file.py::test_x`) and test files (`tests/test_file.py`) cited
    in backticks in the README or a docs page exist (in any subfolder of tests/)."""
    defined = _defined_tests()
    files = {path.name: path for path in _test_files()}
    missing = []
    for page in _front_pages():
        text = page.read_text()
        where = page.relative_to(ROOT)
        missing += [f"{where}: {name}" for name in sorted(_cited_in(text) - defined)]
        for span in re.findall(r"`([^`]+)`", text):
            for name, _, test in re.findall(r"\b(test_\w+\.py)(::(test_\w+))?", span):
                if name not in files:
                    missing.append(f"{where}: {name}")
                elif test and test not in _defined_in(files[name]):
                    missing.append(f"{where}: {name}::{test}")
    assert not missing, missing


def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; move a section to docs/"
    )


def _ci_commands() -> list[str]:
    """The commands .ci/run runs: the first command line after each `# 1.` and `# 2.` comment."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = []
    for step in ("1", "2"):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"# {step}."))
        command = next(
            line for line in lines[start + 1 :] if line.strip() and not line.startswith("#")
        )
        commands.append(command.strip())
    return commands


def test_the_readme_opens_with_the_set_up_commands_ci_runs():
    """A new user's first two commands are the README's first two blocks, and CI runs them."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", README.read_text(), re.S | re.M)
    assert [lang for lang, _ in blocks[:2]] == ["bash", "bash"]
    assert [body.strip() for _, body in blocks[:2]] == _ci_commands()


def test_every_docs_page_opens_with_a_link_back_to_the_readme():
    for page in sorted(DOCS.glob("*.md")):
        head = "\n".join(page.read_text().splitlines()[:10])
        assert "](../README.md)" in head, page.relative_to(ROOT)


def test_the_readme_indexes_every_docs_page():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in _relative_links(README)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, missing
