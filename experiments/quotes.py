"""The verdicts the README and docs/ quote, kept equal to the studies' own: a page quotes a
verdict between markers,

    <!-- verdict round3:mlp-vs-dense -->...<!-- /verdict -->

and ``python -m experiments.quotes`` (from the repository root) rewrites what lies between
them from ``experiments/<study>/findings.json`` ("verdicts": {key: {"text": ...}}), which each
study's report writes through the verdict module (`mixture_of_depths.studies.verdict`). The
tests (experiments/tests/test_quotes.py) fail where a quote is stale, names a verdict no study
has, or where a page words a verdict outside the markers.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
QUOTE = re.compile(r"<!-- verdict ([\w-]+):([\w.-]+) -->(.*?)<!-- /verdict -->", re.S)


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that quote verdicts: the README and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def verdicts(study: str, experiments: Path = EXPERIMENTS) -> dict[str, str]:
    """The verdicts `study` wrote into its findings.json, by key ({} where it wrote none)."""
    path = experiments / study / "findings.json"
    if not path.exists():
        return {}
    found = json.loads(path.read_text()).get("verdicts", {})
    return {key: v["text"] for key, v in found.items()}


def quoted(text: str, experiments: Path = EXPERIMENTS) -> tuple[str, list[str]]:
    """`text` with every quote rewritten from its study's findings, and the quotes that name a
    verdict no study has."""
    missing: list[str] = []
    cache: dict[str, dict[str, str]] = {}

    def fill(m: re.Match[str]) -> str:
        study, key = m.group(1), m.group(2)
        found = cache.setdefault(study, verdicts(study, experiments))
        if key not in found:
            missing.append(f"{study}:{key}")
            return m.group(0)
        return f"<!-- verdict {study}:{key} -->{found[key]}<!-- /verdict -->"

    return QUOTE.sub(fill, text), missing


def outside_quotes(text: str) -> str:
    """`text` less its quotes (what a page says by itself)."""
    return QUOTE.sub("", text)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the quotes of the given pages (default: README.md and docs/*.md) in place;
    exit 1 where a quote names a verdict no study has."""
    paths = [Path(a) for a in (argv if argv is not None else sys.argv[1:])] or pages()
    bad = []
    for page in paths:
        text = page.read_text()
        new, missing = quoted(text)
        bad += [f"{page}: {m}" for m in missing]
        if new != text:
            page.write_text(new)
            print(f"updated {page}")
    for b in bad:
        print(f"no such verdict: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
