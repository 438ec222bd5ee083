"""The figures the README and docs/ quote from runs, kept equal to the committed files they came
from. A page quotes a figure between markers:

    <!-- figure docs/bench/cpu-small.txt train[seq_len=1024][model=c=0.125].speedup|.3f -->
    1.800<!-- /figure -->    (on one line)

naming the file (from the repository root) and where in it the figure is: either ``/REGEX/``,
its first group in the file's text (markdown reports, text tables), quoted verbatim; or
``EXPR``, optionally followed by ``*SCALE`` (``*1e-6``: in millions) and ``|FORMAT``, a Python
format spec (``.3f``, ``.1%``, ``,.0f``), which gives a number (in a table row write ``\\|``:
GitHub ends a cell at a bare ``|``, even inside a comment). ``EXPR`` is terms joined by
`` over ``, `` minus `` or `` plus ``, worked out left to right (``A minus B over B``: the
change from B), each term one of:

- a key path into the file's JSON: a ``.json`` file, a ``.jsonl`` file (a list of its rows), or
  a command's output whose last line starting with ``{`` is JSON (``mod bench``'s). A path step
  is a key (``[a.b]`` for a key with dots, ``["c=1"]`` for any key), a list index, or
  ``[key=value]``: the rows whose key prints as value. ``*`` and ``?`` (any text, any one
  character) in a value or an unquoted key keep every row or key they fit; a path takes the
  first of them;
- ``mean(PATH)``, ``min(PATH)``, ``max(PATH)``, ``sum(PATH)``: over every row the path's
  ``[key=value]`` steps keep (and every item of a list or object value), or over every group
  of every match of a ``/REGEX/`` in their parentheses; ``count(PATH)``: how many rows it keeps;
- ``/REGEX/``: its first group in the file's text, as a number (commas dropped);
- a number.

``python tests/figures.py`` (from the repository root) rewrites what lies between the markers
from the files; tests/test_figures.py fails where a quote is stale or its file or key is gone.
This is apart from the verdict quotes (experiments/quotes.py), which quote the studies' words.
"""

from __future__ import annotations

import json
import re
import sys
from fnmatch import fnmatchcase
from pathlib import Path
from statistics import fmean
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"<!-- figure (\S+) (.+?) -->(.*?)<!-- /figure -->", re.S)
STEP = re.compile(r'\["([^"]*)"\]|\[([^\]=]+)=([^\]]*)\]|\[([^\]]+)\]|\.?([^.\[]+)')
TAIL = re.compile(r"(.*?)(?:\*([-+]?[\d.]+(?:e[-+]?\d+)?))?(?:\\?\|([^|/\])]*))?", re.S)
OPS = {"over": lambda a, b: a / b, "minus": lambda a, b: a - b, "plus": lambda a, b: a + b}
REDUCE = {"mean": fmean, "min": min, "max": max, "sum": sum, "count": len}
NUMBER = re.compile(r"[-+]?[\d.]+(?:e[-+]?\d+)?")


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


def reach(doc: Any, path: str, every: bool = False) -> list[Any]:
    """The values at a key path such as ``train[seq_len=256][model=c=0.125].tokens_per_s``: the
    first row's (a list of one), or with `every` every row's that the ``[key=value]`` steps keep."""
    docs, filtering = [doc], False
    for m in STEP.finditer(path):
        quoted_key, key, want, literal, name = m.groups()
        if key is not None:
            rows = docs if filtering else [r for d in docs if isinstance(d, list) for r in d]
            docs = [r for r in rows if isinstance(r, dict) and fnmatchcase(str(r.get(key)), want)]
            filtering = True
            continue
        docs, filtering = docs if every or not filtering else docs[:1], False
        name = quoted_key if quoted_key is not None else literal or name
        if quoted_key is None and ("*" in name or "?" in name):  # every key it fits
            docs = [v for d in docs for k, v in d.items() if fnmatchcase(k, name)]
            docs = docs if every else docs[:1]
            continue
        docs = [d[int(name)] if isinstance(d, list) else d[name] for d in docs]
    docs = docs if every or not filtering else docs[:1]
    if not docs:
        raise KeyError(f"no row has {path}")
    return docs


def lookup(doc: Any, path: str) -> Any:
    """The value at a key path (the first row's where its steps keep several)."""
    return reach(doc, path)[0]


def terms(expr: str) -> list[str]:
    """`expr` cut at its operators (`` over ``, `` minus ``, `` plus ``) outside brackets,
    parentheses and regexes: term, operator, term, ..."""
    out, start, depth, i = [], 0, 0, 0
    while i < len(expr):
        c = expr[i]
        if c == "/" and i == start:  # a regex term runs to its next unescaped slash
            i += 1
            while i < len(expr) and (expr[i] != "/" or expr[i - 1] == "\\"):
                i += 1
        elif c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        elif c == " " and depth == 0:
            word = expr[i + 1 :].split(" ", 1)[0]
            if word in OPS and expr[i + 1 + len(word) : i + 2 + len(word)] == " ":
                out += [expr[start:i], word]
                start = i = i + len(word) + 2
                continue
        i += 1
    return [*out, expr[start:]]


def number(term: str, path: Path, doc: Any) -> float:
    """One term's number (see the module docstring)."""
    if term.startswith("/") and term.endswith("/") and len(term) > 1:
        m = re.search(term[1:-1], path.read_text())
        if m is None:
            raise KeyError(f"no match for {term}")
        return float(m.group(1).replace(",", ""))
    if NUMBER.fullmatch(term):
        return float(term)
    fn, _, inner = term.partition("(")
    if fn in REDUCE and inner.endswith(")"):
        inner = inner[:-1]
        if inner[:1] == inner[-1:] == "/" and len(inner) > 1:  # every group of every match
            found = [g.replace(",", "") for m in re.finditer(inner[1:-1], path.read_text())
                     for g in m.groups()]  # fmt: skip
            return REDUCE[fn]([float(g) for g in found])
        found = reach(doc(), inner, every=True)
        if fn != "count":  # the items of a list or object value
            found = [x for v in found for x in (v.values() if isinstance(v, dict) else [v])]
            found = [x for v in found for x in (v if isinstance(v, list) else [v])]
        return REDUCE[fn](found)
    return lookup(doc(), term)


def value(source: str, locator: str, root: Path = ROOT) -> str:
    """The text a figure's markers should hold: `locator` applied to the file `source`."""
    path = root / source
    expr, scale, spec = TAIL.fullmatch(locator).groups()
    parts = terms(expr)
    if len(parts) == 1 and expr[:1] == expr[-1:] == "/" and not scale and spec is None:
        m = re.search(expr[1:-1], path.read_text())  # a regex quoted verbatim
        if m is None:
            raise KeyError(f"{source}: no match for {locator}")
        return m.group(1)
    cache: list[Any] = []

    def doc() -> Any:
        cache[:] = cache or [load(path)]
        return cache[0]

    got = number(parts[0], path, doc)
    for op, term in zip(parts[1::2], parts[2::2], strict=True):
        got = OPS[op](got, number(term, path, doc))
    return format(got * float(scale) if scale else got, spec or "")


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
