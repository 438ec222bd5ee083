"""The figures the README and docs/ quote from runs, kept equal to the committed files they came
from. A page quotes a figure between markers:

    <!-- figure docs/bench/cpu-small.txt train[seq_len=1024][model=c=0.125].speedup|.3f -->
    1.800<!-- /figure -->    (on one line)

naming the file (from the repository root) and where in it the figure is:

- a key path into the file's JSON: a ``.json`` file, a ``.jsonl`` file (a list of its rows), or
  a command's output whose last line starting with ``{`` is JSON (``mod bench``'s), or two
  such paths as ``A over B`` (their ratio), then optionally ``*SCALE`` (``*1e-6``: in
  millions) and ``|FORMAT``, a Python format spec
  (``.3f``, ``.1%``, ``,.0f``); a path step is a key (``[a.b]`` for a key with dots), a list
  index, or ``[key=value]``, the rows whose key prints as value (the first that all such steps
  in a row keep);
- or ``/REGEX/``: its first group in the file's text (markdown reports, text tables), verbatim.

``python tests/figures.py`` (from the repository root) rewrites what lies between the markers
from the files; tests/test_figures.py fails where a quote is stale or its file or key is gone.
This is apart from the verdict quotes (experiments/quotes.py), which quote the studies' words.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"<!-- figure (\S+) (.+?) -->(.*?)<!-- /figure -->", re.S)
STEP = re.compile(r"\[([^\]=]+)=([^\]]*)\]|\[([^\]]+)\]|\.?([^.\[]+)")


def pages(root: Path = ROOT) -> list[Path]:
    """The pages that quote figures: the README and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def load(path: Path) -> Any:
    """The JSON of a figure's file (see the module docstring)."""
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    last = [line for line in text.splitlines() if line.startswith("{")]
    if not last:
        raise ValueError(f"{path} has no JSON line")
    return json.loads(last[-1])


def lookup(doc: Any, path: str) -> Any:
    """The value at a key path such as ``train[seq_len=256][model=c=0.125].tokens_per_s``."""
    rows = None  # the rows the ``[key=value]`` steps so far keep (they all must hold)
    for m in STEP.finditer(path):
        key, want, literal, name = m.groups()
        name = literal or name
        if key is not None:
            rows = [r for r in (doc if rows is None else rows) if str(r.get(key)) == want]
            continue
        if rows is not None:
            doc, rows = rows[0], None
        doc = doc[int(name)] if isinstance(doc, list) else doc[name]
    return doc if rows is None else rows[0]


def value(source: str, locator: str, root: Path = ROOT) -> str:
    """The text a figure's markers should hold: `locator` applied to the file `source`."""
    path = root / source
    if locator.startswith("/") and locator.endswith("/"):
        m = re.search(locator[1:-1], path.read_text())
        if m is None:
            raise KeyError(f"{source}: no match for {locator}")
        return m.group(1)
    key, _, spec = locator.partition("|")
    key, _, scale = key.partition("*")
    doc = load(path)
    top, _, bottom = key.partition(" over ")  # a ratio of two values of the file
    got = lookup(doc, top) / lookup(doc, bottom) if bottom else lookup(doc, key)
    return format(got * float(scale) if scale else got, spec)


def quoted(text: str, root: Path = ROOT) -> tuple[str, list[str]]:
    """`text` with every figure rewritten from its file, and the figures that cannot be found."""
    missing: list[str] = []

    def fill(m: re.Match[str]) -> str:
        source, locator = m.group(1), m.group(2)
        try:
            got = value(source, locator, root)
        except (OSError, ValueError, KeyError, IndexError, TypeError,
                AttributeError) as exc:  # fmt: skip
            missing.append(f"{source} {locator} ({type(exc).__name__}: {exc})")
            return m.group(0)
        return f"<!-- figure {source} {locator} -->{got}<!-- /figure -->"

    return FIGURE.sub(fill, text), missing


def main(argv: list[str] | None = None) -> int:
    """Rewrite the figures of the given pages (default: README.md and docs/*.md) in place;
    exit 1 where a figure's file or key is gone."""
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
        print(f"no such figure: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
