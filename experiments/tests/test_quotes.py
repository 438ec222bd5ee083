"""The verdicts the README, docs/ and the studies' READMEs state are the studies' own, quoted
(experiments/quotes.py): every quote is current and names a verdict a study wrote, and no page
words a verdict by itself outside a quote."""

from __future__ import annotations

import re
from pathlib import Path

from experiments import quotes

ROOT = quotes.ROOT
# What only the verdict module may say (mixture_of_depths.studies.verdict.WORDS and the old
# reports' words for the same judgements).
PHRASES = ("within the spread", "within the seed spread", "within its spread",
           "beyond the spread", "beyond the seed spread", "not bracketed", "grid's edge",
           "not testable here", "one seed (a reading)")  # fmt: skip
WORDS = re.compile(r"\b(better|worse|supported|contradicted|beats|ahead)\b", re.I)
RULES = re.compile(r"<!-- rules -->.*?<!-- /rules -->", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def pages() -> list[Path]:
    return [*quotes.pages(ROOT), *sorted((ROOT / "experiments").glob("*/README.md")),
            ROOT / "experiments" / "README.md"]  # fmt: skip


def own_words(text: str) -> str:
    """What a page says by itself: less its quotes, its rules block and its code."""
    return CODE.sub("", RULES.sub("", quotes.outside_quotes(text)))


def test_every_quote_is_current_and_names_a_verdict_a_study_wrote():
    stale, missing = [], []
    for page in pages():
        text = page.read_text()
        new, gone = quotes.quoted(text)
        missing += [f"{page.relative_to(ROOT)}: {m}" for m in gone]
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
    assert not missing, missing
    assert not stale, f"stale quotes (run python -m experiments.quotes): {stale}"


def test_no_page_words_a_verdict_by_itself():
    found = []
    for page in pages():
        for line in own_words(page.read_text()).splitlines():
            hits = [p for p in PHRASES if p in line.lower()] + WORDS.findall(line)
            if hits:
                found.append(f"{page.relative_to(ROOT)}: {hits}: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_a_quote_is_rewritten_from_its_studys_findings(tmp_path):
    study = tmp_path / "exp" / "s1"
    study.mkdir(parents=True)
    (study / "findings.json").write_text('{"verdicts": {"k": {"text": "A against B: new"}}}')
    page = (
        "x <!-- verdict s1:k -->old<!-- /verdict --> y <!-- verdict s1:nope -->?<!-- /verdict -->"
    )
    new, missing = quotes.quoted(page, tmp_path / "exp")
    assert new.startswith("x <!-- verdict s1:k -->A against B: new<!-- /verdict --> y")
    assert missing == ["s1:nope"]
