"""`mod study experiments/mor --quick` on a cut-down plan: every run trains to its budget
(charged by `estimate_flops`, MoR priced per recursion step), each arm's best width gets a
second seed, the pairs apart from the grid train with two seeds, every cell's models are timed
side by side, and the report judges the paper's claims through the verdict module (and says
"not run yet" without them); the committed report is what its committed results make."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from experiments.common import measure
from experiments.mor import report
from experiments.mor import study as mor
from mixture_of_depths import MoDConfig
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.studies import runner, verdict

FOLDER = Path(mor.__file__).parent  # the committed results, report and findings


def test_the_plan_completes_the_small_budget_and_the_pairs_before_the_large_grid():
    specs = mor.plan(mor.FULL)
    budgets = [sp.budget for sp in specs if sp.group == "isoflop"]
    assert budgets == sorted(budgets)
    first_large = next(  # the 5e13 grid (its dense M run is the params pair's reference)
        i for i, sp in enumerate(specs)
        if sp.group == "isoflop" and sp.budget == 5e13 and sp.name != "5e13-dense-M-T256-s0"
    )  # fmt: skip
    pairs = [i for i, sp in enumerate(specs) if sp.group in ("sharing", "params")]
    assert pairs and max(pairs) < first_large
    sizes = {sp.budget: set() for sp in specs}
    for sp in specs:
        if sp.group == "isoflop":
            sizes[sp.budget].add(mor.size_of(sp.__dict__))
    assert sizes == {1.5e13: {"XXXS", "XXS", "XS"}, 5e13: {"XXS", "XS"}}
    for sp in specs:  # cycle sharing: the middle-cycle grid arm of its width, cycled
        if sp.group == "sharing":
            ref = next(
                g for g in specs
                if g.label == "MoR expert, recursion KV" and g.budget == sp.budget
                and g.seq_len == sp.seq_len and mor.size_of(g.__dict__) == mor.size_of(sp.__dict__)
            )  # fmt: skip
            diff = {k for k in {*sp.model, *ref.model} if sp.model.get(k) != ref.model.get(k)}
            assert diff == {"recursion_sharing"} and sp.model["recursion_sharing"] == "cycle"
    names = [sp.name for sp in specs]
    # each pair: both sides at one width with two seeds each, before the large grid; the
    # reference side is the grid's own run (the same name: it trains once)
    for ref in ("1.5e13-mor-er-XS-T256", "1.5e13-mor-er-XS-T1024", "5e13-dense-M-T256"):
        assert {f"{ref}-s0", f"{ref}-s1"} <= set(names[:first_large])
    assert {"5e13-p-mor-M-T256-s0", "5e13-p-mor-M-T256-s1"} <= set(names[:first_large])
    assert len(set(names)) == len(names) - 2  # the reference runs the grid plans again
    dense_m = next(sp for sp in specs if sp.name == "5e13-dense-M-T256-s0")  # not in the grid
    assert dense_m.label == "dense" and MoDConfig(**dense_m.model).d_model == 128


def test_quick_mor_plan_trains_to_budget_and_judges_the_claims(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(mor, "QUICK", dataclasses.replace(mor.QUICK, budgets=(1e9,)))
    keep = {"dense", "MoR expert, recursion KV", "MoR token, shared KV"}
    monkeypatch.setattr(mor, "ARMS", tuple(a for a in mor.ARMS if a[0] in keep))
    monkeypatch.setattr(mor, "_lengths", lambda settings: ((32, 4),))
    monkeypatch.setattr(measure, "DECODE_ROUNDS", 2)
    monkeypatch.setattr(measure, "DECODE_NEW", 4)
    out, work = tmp_path / "mor", tmp_path / "work"
    results = runner.study(mor.PLAN, out, work, quick=True, data=str(corpus), progress=False)
    grid = [r for r in results if r["group"] == "isoflop"]
    # the grid, the two pairs (two seeds a side; the reference's seed 0 is the grid's), the
    # grid's second seeds (the references' among them)
    assert len(grid) == 3 and len(results) == 3 + 2 + 2 + 3
    for r in results:
        cfg = MoDConfig(**r["model"])
        step = estimate_flops(cfg, r["seq_len"], r["batch_size"]).train
        assert r["steps"] == int(r["budget"] // step) and r["flops_budget_used"] <= r["budget"]
    rec = next(r for r in grid if r["label"] == "MoR expert, recursion KV")
    assert set(rec["routing_accuracy"]) == {"1.recursion", "2.recursion"}
    text = (out / "report.md").read_text()
    assert "MoR (expert choice) reaches a lower loss" in text and (out / "mor.png").exists()
    # every arm's model of the cell was timed, side by side, once
    timed = mor.decode_rows(out)
    assert set(timed) == {x["name"] for x in mor.cells(results).values()}
    assert all(t["decode_tok_s_b1"] > 0 and t["decode_tok_s_b8"] > 0 for t in timed.values())
    rows = {r.claim.key: r for r in report.claim_rows(results, timed)}  # one budget and length
    first = rows["mor-vs-dense"].verdict
    assert first is not None and first.word in verdict.WORDS, first
    # every arm trained at one learning rate at one width: both open ends named
    assert first.a.unbracketed == first.b.unbracketed == "one learning rate tried (2e-3)"
    assert first.a.edge == "one width tried (S)"
    assert rows["mor-vs-recursive"].verdict is None  # no plain recursive arm ran
    assert rows["mor-vs-recursive"].status == "not run yet"
    sharing = rows["middle-cycle-vs-cycle"].verdict
    assert sharing is not None and sharing.word in verdict.WORDS, sharing
    speed = rows["decode-speed"]
    assert speed.verdict is not None and speed.verdict.word == verdict.UNTESTABLE
    assert "x at batch 8" in speed.sides
    loaded = {n: {**t, "others_busy": 0.3} for n, t in timed.items()}  # timed beside a study
    speed = {r.claim.key: r for r in report.claim_rows(results, loaded)}["decode-speed"]
    assert "timed while other processes used 30% of the CPUs" in speed.sides
    # KV bytes as routed: the cache at the causal take-rates each run measured, recomputed
    token = next(r for r in grid if r["label"] == "MoR token, shared KV")
    for r in (rec, token):
        takes = [r["causal_take_rate"][f"{s}.recursion"] for s in (1, 2)]
        cell = next(v for v in mor.cells([r]).values())
        cfg = MoDConfig(**r["model"])
        want = estimate_flops(cfg, r["seq_len"], with_dense=False, take_rate=takes)
        assert cell["kv_bytes_per_token_routed"] == pytest.approx(want.kv_bytes_per_token)
    before = (out / "decode.jsonl").read_text()
    mor.measure(results, out, work, str(corpus))  # nothing new to time: nothing timed again
    assert (out / "decode.jsonl").read_text() == before
    # seed 0's checkpoint lost: the same width's seed 1 is timed in its place
    cell = next(x for x in mor.cells(results).values() if len(x["names"]) > 1)
    shutil.rmtree(work / cell["name"])
    mor.measure(results, out, work, str(corpus))  # timed already: its folder's loss changes none
    assert (out / "decode.jsonl").read_text() == before
    (out / "decode.jsonl").unlink()
    mor.measure(results, out, work, str(corpus))
    again = mor.cells(results, None, mor.decode_rows(out))
    stand_in = next(x for x in again.values() if x["name"] == cell["name"])
    assert stand_in["timed"] == cell["names"][1] and stand_in["decode_tok_s_b1"] > 0
    mor.write_report([], tmp_path / "empty", mor.QUICK)
    assert "Not run yet." in (tmp_path / "empty" / "report.md").read_text()


def test_each_length_gets_its_second_seeds_before_the_next_lengths_grid(
    tmp_path, monkeypatch, capsys
):
    order = []

    def fake(spec, *a, **kw):  # a row as run_one writes it, without training
        order.append(spec.name)
        loss = 4.0 + 0.01 * len(order)
        return {**dataclasses.asdict(spec), "model": {**spec.model, "vocab_size": 4096},
                "val_loss_causal": loss, "val_loss_topk": loss, "params": 1}  # fmt: skip

    monkeypatch.setattr(runner, "run_one", fake)
    monkeypatch.setattr(mor, "write_report", lambda *a, **k: None)
    runner.study(mor.PLAN, tmp_path / "out", tmp_path / "work", progress=False)
    first = [n for n in order if n.startswith("1.5e13")]
    pairs = {sp.name for sp in mor.plan(mor.FULL) if sp.name.endswith("-s1")}  # the pairs' only
    grid_1024 = [i for i, n in enumerate(order) if n.startswith("1.5e13") and "T1024-s0" in n]
    seeds_256 = [i for i, n in enumerate(order) if "T256-s1" in n and n.startswith("1.5e13")]
    seeds_256 = [i for i in seeds_256 if order[i] not in pairs]
    assert seeds_256 and max(seeds_256) < min(grid_1024)
    assert len(seeds_256) == len(mor.ARMS) and len(order) == len(set(order))
    assert first == order[: len(first)]  # the small budget, its seeds and pair, before 5e13
    logged = [ln for ln in capsys.readouterr().out.splitlines() if ": causal loss " in ln]
    assert [ln.split(":")[0] for ln in logged] == order  # without a bar, a line per run


def test_the_best_width_is_chosen_on_the_seeds_every_width_trained():
    """The width whose seed 0 won got the second seed (`seed_specs`); a poor second seed must
    not hand the cell to a width with one seed whose lone loss beats the two-seed mean."""
    spec = next(sp for sp in mor.plan(mor.FULL) if sp.name.startswith("5e13-mor-er-XXS-T256"))

    def row(size, seed, loss):
        name = f"5e13-mor-er-{size}-T256-s{seed}"
        return {**dataclasses.asdict(spec), "name": name, "seed": seed,
                "val_loss_causal": loss, "params": 1}  # fmt: skip

    results = [row("XXS", 0, 2.96), row("XS", 0, 2.98), row("XXS", 1, 3.23)]
    assert [sp.name for sp in mor.seed_specs(results, 5e13, 256)] == ["5e13-mor-er-XXS-T256-s1"]
    (cell,) = mor.cells(results).values()
    assert cell["names"] == ["5e13-mor-er-XXS-T256-s0", "5e13-mor-er-XXS-T256-s1"]
    assert cell["loss"] == pytest.approx((2.96 + 3.23) / 2) and cell["gap"] == pytest.approx(0.27)
    # with the other width's seed 1 in too, both are judged on both seeds
    results.append(row("XS", 1, 3.00))
    (cell,) = mor.cells(results).values()
    assert cell["names"][0] == "5e13-mor-er-XS-T256-s0"


def test_the_committed_report_is_what_the_committed_results_make(tmp_path: Path):
    """`mod study experiments/mor --report` from the committed results and decode speeds, into
    a folder of its own: the report and findings equal the committed ones, byte for byte."""
    for name in ("results.jsonl", "decode.jsonl"):
        shutil.copy(FOLDER / name, tmp_path / name)
    runner.rewrite_report(mor.PLAN, tmp_path)
    for name in ("report.md", "findings.json"):
        assert (tmp_path / name).read_bytes() == (FOLDER / name).read_bytes(), name


def test_the_committed_verdicts_judge_by_the_rules():
    """No claim wins on a rate tried once; the equal-parameter claim is judged against dense's
    best width as well as the pair's; a GPU throughput claim is not testable on one CPU thread."""
    results = runner.load_results(FOLDER / "results.jsonl")
    rows = {r.key: r for r in report.claim_rows(results, mor.decode_rows(FOLDER))}
    judged = [r.verdict for r in rows.values() if r.verdict is not None]
    assert len(judged) == len(rows) == 28
    assert not any(v.word in (verdict.BETTER, verdict.WORSE) for v in judged)
    best = rows["params-vs-dense-best-5e13-t256"].verdict
    assert best.b.label == "dense (XS)" and best.b.edge is None and best.diff > best.spread
    same = rows["params-vs-dense-same-width-5e13-t256"].verdict
    assert same.b.label == "dense (M)" and "not its best width here (XS)" in same.b.edge
    speeds = [r.verdict for k, r in rows.items() if k.startswith("decode-speed")]
    assert len(speeds) == 4 and all(v.word == verdict.UNTESTABLE for v in speeds)
    wide = rows["mor-vs-dense-1.5e13-t256"].verdict  # beyond the spread, at the grid's edge
    assert wide.word == verdict.UNBRACKETED and "smallest tried" in " ".join(wide.caveats)
