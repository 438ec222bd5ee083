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
MARKED = (
    "README.md",
    "docs/inspect.md",
    "docs/semantics.md",
    "docs/bench.md",
    "docs/kv.md",
    "docs/mode.md",
    "docs/mor.md",
    "docs/huggingface.md",
    "docs/serving.md",
    "docs/study.md",
)


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


def test_the_key_language_reduces_rows_matches_names_and_does_arithmetic(tmp_path):
    rows = [{"name": "x-s0", "f": 1.0, "l": [0.5, 0.7]}, {"name": "x-s1", "f": 2.0, "l": [0.6]}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    keyed = {"c=1": {"v": 4.0}, "a.b": 2.0, "m": {"x": 1, "y": 3}}
    keyed["g"] = {"p": {"v": 1}, "q": {"v": 3}}
    (tmp_path / "k.json").write_text(json.dumps(keyed))
    (tmp_path / "t.txt").write_text("| 0.125 | 6,568 | 0.8 |\n| 40% 60% |\n| 50% 70% |\n")
    cases = {
        ("r.jsonl", "mean([name=x-s?].f)|.2f"): "1.50",
        ("r.jsonl", "max([name=x-*].l)|.1f"): "0.7",
        ("r.jsonl", "count([name=x-*])"): "2",
        ("k.json", "mean(m)|.1f"): "2.0",
        ("k.json", "max(g.*.v)"): "3",
        ("k.json", "g.?.v"): "1",
        ("r.jsonl", "[name=x-s1].f over [name=x-s0].f minus 1|+.0%"): "+100%",
        ("k.json", '["c=1"].v minus [a.b] over [a.b]\\|.1f'): "1.0",
        ("t.txt", r"/\| 0\.125 \| ([\d,]+)/ over /([\d.]+) \|\n/*1e-3|,.2f"): "8.21",
        ("t.txt", r"/\| 0\.125 \| ([\d,]+)/"): "6,568",
        ("t.txt", r"mean(/(\d+)% (\d+)%/)|.0f"): "55",
    }
    for (source, locator), want in cases.items():
        assert figures.value(source, locator, tmp_path) == want, locator


def test_a_figure_in_a_table_row_escapes_its_pipes():
    """GitHub splits a table row at every bare ``|``, inside an HTML comment too: a figure in a
    table writes ``\\|FORMAT`` (tests/figures.py reads both) and no bare pipe in a regex."""
    bare = []
    for page in figures.pages():
        for line in page.read_text().splitlines():
            if line.lstrip().startswith("|"):
                bare += [f"{page.name}: {loc}" for _, loc, _ in figures.FIGURE.findall(line)
                         if re.search(r"(?<!\\)\|", loc)]  # fmt: skip
    assert not bare, bare


def test_no_figure_sits_in_code():
    """A marker in a code block or span would show as text, not as its figure."""
    code = re.compile(r"^```.*?^```|`[^`\n]*`", re.S | re.M)
    shown = [f"{page.name}: {m[:80]}" for page in figures.pages()
             for m in code.findall(page.read_text()) if "<!-- figure" in m]  # fmt: skip
    assert not shown, shown


def test_the_bench_pages_full_attention_predictions_are_the_bench_models_flop_counts():
    """docs/bench.md gives the committed bench run's FLOP-predicted speed-ups with attention
    counted in full beside its causal ones; no file holds them, so they are worked out here from
    the models that run measured (`mod bench`'s own configs with the aux-loss router, the
    default then: their causal predictions equal the file's) and the file's speed-ups."""
    import argparse
    import dataclasses

    from mixture_of_depths.bench import sections
    from mixture_of_depths.flops import estimate_flops

    bench = figures.load(ROOT / "docs" / "bench" / "cpu-small.txt")
    text = " ".join((ROOT / "docs" / "bench.md").read_text().split())
    full = re.search(r"Counted in full, the c=0\.125 predictions below would be ([\d.]+)x / "
                     r"([\d.]+)x / ([\d.]+)x at T=256 / 1024 / 2048, and the efficiencies "
                     r"([\d.]+)% / ([\d.]+)% / ([\d.]+)%", text)  # fmt: skip
    block = re.search(r"predicted with causal attention, ([\d.]+)x and ([\d.]+)x with", text)
    args = argparse.Namespace(preset="small", layer_pattern="DR", capacities=[0.125],
                              skipped_kv="none")  # fmt: skip
    got_full, got_eff, got_block = [], [], []
    for seq_len in (256, 1024, 2048):
        cfgs = {name: dataclasses.replace(cfg, causal_router="aux_loss")
                for name, cfg in sections.model_configs(args, seq_len).items()}  # fmt: skip
        f = estimate_flops(cfgs["c=0.125"], seq_len, 4096 // seq_len)
        row = figures.lookup(bench, f"train[seq_len={seq_len}][model=c=0.125]")
        assert f.dense.train_causal / f.train_causal == pytest.approx(
            row["speedup_flop_predicted"]
        )  # the models the run measured
        got_full.append(f"{f.dense.train / f.train:.3f}")
        got_eff.append(f"{100 * row['speedup'] / (f.dense.train / f.train):.1f}")
        one = {k: sections._one_block(c, routed=k != "dense") for k, c in cfgs.items()}
        layer = {k: estimate_flops(c, seq_len, 4096 // seq_len).layers[0] for k, c in one.items()}
        fwd = {k: v.matmul + v.attention + v.router + v.predictor for k, v in layer.items()}
        got_block.append(f"{fwd['dense'] / fwd['c=0.125']:.1f}")
    assert list(full.groups()) == got_full + got_eff
    assert list(block.groups()) == [got_block[0], got_block[2]]


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


def test_the_kv_pages_prices_are_what_mod_flops_counts_now():
    """docs/kv.md prices `skipped_kv` with `mod flops` for today's `small` at 1024 tokens: a
    change of the default model or of the count fails here."""
    from mixture_of_depths import MoDConfig
    from mixture_of_depths.flops import estimate_flops

    text = " ".join((ROOT / "docs" / "kv.md").read_text().split())
    pattern = (
        r"a training step costs ([\d.]+)x of dense against ([\d.]+)x for "
        r'`"none"`, and the KV cache ([\d.]+)x of dense against ([\d.]+)x'
    )
    quoted = re.search(pattern, text)
    now = {}
    for kv in ("residual", "none"):
        f = estimate_flops(MoDConfig.preset("small", max_seq_len=1024, skipped_kv=kv), 1024)
        now[kv] = (f.train / f.dense.train, f.kv_bytes_per_token / f.dense.kv_bytes_per_token)
    want = [f"{now['residual'][0]:.3f}", f"{now['none'][0]:.3f}"]
    want += [f"{now['residual'][1]:.1f}", f"{now['none'][1]:.2f}"]
    assert list(quoted.groups()) == want


def test_the_mor_pages_flop_ratios_are_what_mod_flops_counts_now():
    """docs/mor.md prices `small-mor` against `small` per training token at 256 tokens, with its
    capacities and with the default ones."""
    from mixture_of_depths import MoDConfig
    from mixture_of_depths.flops import estimate_flops

    text = " ".join((ROOT / "docs" / "mor.md").read_text().split())
    pattern = r"training FLOPs per token: ([\d.]+)x at 256 tokens .*? it would cost ([\d.]+)x\."
    quoted = re.search(pattern, text)
    small = estimate_flops(MoDConfig.preset("small"), 256).train
    mor = [MoDConfig.preset("small-mor"), MoDConfig.preset("small-mor", recursion_capacities=None)]
    assert list(quoted.groups()) == [f"{estimate_flops(c, 256).train / small:.2f}" for c in mor]


def test_the_distributed_pages_nccl_table_is_todays_arithmetic(capsys):
    """docs/distributed.md tables `benchmarks/distributed.py --nccl` (arithmetic, nothing run):
    a change of the default model, the FLOP count or the parameter count fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dist", ROOT / "benchmarks" / "distributed.py")
    dist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dist)
    models = dist.nccl_estimate(dist.parse(["--nccl"]))["models"]
    capsys.readouterr()
    text = (ROOT / "docs" / "distributed.md").read_text()
    for label, m in zip(("MoD", "dense twin"), models, strict=True):
        ddp = m["ddp"]
        want = [f"{m['params'] / 1e6:.0f}M", f"{m['train_flops_per_token'] / 1e9:.2f}",
                f"{m['compute_ms']:.0f} ms", f"{ddp['bytes_per_rank'] / 1e9:.1f} GB",
                f"{ddp['nvlink_ms']:.0f} ms", f"{ddp['network_ms']:.0f} ms",
                f"{ddp['tokens_per_gpu_compute_equals_network']:,.0f}"]  # fmt: skip
        row = re.search(rf"^  \| {label} \| (.*) \|$", text, re.M).group(1).split(" | ")
        assert row == want, label
