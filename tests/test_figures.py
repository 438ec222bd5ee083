"""Every figure the README and docs/ quote from a run is the committed file's (tests/figures.py):
each quote between ``<!-- figure FILE KEY -->`` markers equals what its file holds, so a new
default or a rerun cannot leave the pages behind; a few pages must quote their run figures so."""

from __future__ import annotations

import json
import re

import figures
import pytest

ROOT = figures.ROOT
# Pages whose figures from runs all come from committed files through markers (the rest of
# docs/ is not yet converted: their figures are checked by their own studies' tests or not).
MARKED = ("README.md", "docs/inspect.md", "docs/semantics.md")


def test_every_figure_is_its_files_and_exists():
    stale, missing = [], []
    for page in figures.pages():
        text = page.read_text()
        new, gone = figures.quoted(text)
        missing += [f"{page.relative_to(ROOT)}: {m}" for m in gone]
        if new != text:
            stale.append(str(page.relative_to(ROOT)))
    assert not missing, missing
    assert not stale, f"stale figures (run python tests/figures.py): {stale}"


@pytest.mark.parametrize("page", MARKED)
def test_the_pages_quote_their_run_figures_through_markers(page):
    assert len(figures.FIGURE.findall((ROOT / page).read_text())) >= 5


def test_a_figure_is_rewritten_from_its_file_and_a_gone_key_is_named(tmp_path):
    rows = '[{"T": 256, "m": "c=1", "s": 1.0}, {"T": 256, "m": "c=0.125", "s": 1.7809}]'
    (tmp_path / "r.txt").write_text(f'log line\n{{"train": {rows}}}\n')
    (tmp_path / "rows.jsonl").write_text('{"name": "a", "f": 3011200.0}\n{"name": "b", "f": 1}\n')
    (tmp_path / "report.md").write_text("| 0 | 6568 | 4593.7 |\n")
    page = (
        "<!-- figure r.txt train[T=256][m=c=0.125].s|.3f -->1.700<!-- /figure --> "
        "<!-- figure rows.jsonl [name=a].f*1e-6|.2f -->?<!-- /figure --> "
        r"<!-- figure report.md /\| 0 \| (\d+) \|/ -->?<!-- /figure --> "
        "<!-- figure r.txt train[T=9].s|.3f -->1<!-- /figure -->"
    )
    new, missing = figures.quoted(page, tmp_path)
    got = re.findall(r"-->([^<]*)<!-- /figure", new)
    assert got == ["1.781", "3.01", "6568", "1"]
    assert len(missing) == 1 and "train[T=9]" in missing[0]


def test_the_readmes_default_run_minutes_follow_its_quoted_speeds():
    """The README's minutes for the default run's steps are its 600 steps of 4,096 tokens at the
    two step speeds it quotes from the committed bench outputs."""
    text = (ROOT / "README.md").read_text()
    para = text[text.index("How long the default run takes") :].split("\n\n")[0]
    speeds = [float(v.replace(",", "")) for _, _, v in figures.FIGURE.findall(para)]
    low, high = re.search(r"that is ([\d.]+) to ([\d.]+)\s+minutes", para).groups()
    minutes = sorted(600 * 4096 / s / 60 for s in speeds)
    assert [float(low), float(high)] == [round(m, 1) for m in minutes]


def test_the_committed_flop_count_is_what_mod_flops_prints_now(capsys):
    """docs/bench/flops-small.json (docs/semantics.md quotes its ratios) is `mod flops --preset
    small --json` of today's code: a change of the default model or the count fails here."""
    from mixture_of_depths.cli import main

    assert main(["flops", "--preset", "small", "--json"]) == 0
    now = json.loads(capsys.readouterr().out)
    assert now == json.loads((ROOT / "docs" / "bench" / "flops-small.json").read_text())
