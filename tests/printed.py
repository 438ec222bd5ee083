"""Snippets that print what their comments say: the README's Python tour and examples/.

A statement that prints may end with a comment ``# -> EXPECTED``. Run through `run_checked`,
every line that statement printed must match EXPECTED: ``~x`` is a number within 5% of x,
``...`` stands for any text, and the rest must be equal (runs of spaces count as one).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from typing import Any

ARROW = re.compile(r"#\s*->\s*(.+?)\s*$")  # a comment that starts with ->
PART = re.compile(r"(~-?\d+(?:\.\d+)?|\.\.\.)")
NUMBER = r"(-?\d+(?:\.\d+)?(?:e-?\d+)?)"


def expectations(source: str) -> dict[tuple[int, int], str]:
    """{(first line, last line) of the statement: EXPECTED} for each ``# -> EXPECTED``."""
    stmts = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.stmt)]
    comments = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT]  # fmt: skip
    out = {}
    for tok in comments:
        m, i = ARROW.match(tok.string), tok.start[0]
        if m is None:
            continue
        holder = min((s for s in stmts if s.lineno <= i <= s.end_lineno),
                     key=lambda s: s.end_lineno - s.lineno)  # fmt: skip
        out[(holder.lineno, holder.end_lineno)] = m.group(1)
    return out


def matches(expected: str, printed: str) -> bool:
    """Whether `printed` is what `expected` says (see the module docstring)."""
    pattern, want = "", []
    for part in PART.split(" ".join(expected.split())):
        if part == "...":
            pattern += ".*"
        elif part.startswith("~"):
            pattern += NUMBER
            want.append(float(part[1:]))
        else:
            pattern += re.escape(part)
    m = re.fullmatch(pattern, " ".join(printed.split()))
    if m is None:
        return False
    got = [float(g) for g in m.groups()]
    return all(abs(g - w) <= 0.05 * abs(w) for g, w in zip(got, want, strict=True))


def run_checked(source: str, filename: str, require: bool = True) -> list[str]:
    """Run `source` as a script; the mismatches between what its statements printed and their
    ``# -> EXPECTED`` comments ([] when all match, and, with `require`, one at least was
    checked)."""
    printed: list[tuple[int, str]] = []

    def record(*args: Any, sep: str = " ", end: str = "\n", file: Any = None, **_: Any) -> None:
        if file not in (None, sys.stdout):
            print(*args, sep=sep, end=end, file=file)
            return
        frame = sys._getframe(1)
        while frame.f_code.co_filename != filename:  # a print in a function of the script
            frame = frame.f_back
        buf = io.StringIO()
        print(*args, sep=sep, end=end, file=buf)
        printed.extend((frame.f_lineno, line) for line in buf.getvalue().splitlines())

    exec(compile(source, filename, "exec"), {"__name__": "__main__", "print": record})  # noqa: S102
    wanted = expectations(source)
    problems = [] if wanted or not require else [f"{filename}: no '# -> EXPECTED' to check"]
    for (first, last), expected in wanted.items():
        got = [text for line, text in printed if first <= line <= last]
        if not got:
            problems.append(f"{filename}:{first}: printed nothing, expected {expected!r}")
        problems += [f"{filename}:{first}: printed {g!r}, expected {expected!r}"
                     for g in got if not matches(expected, g)]  # fmt: skip
    return problems
