"""Round 4's plan follows its rule (README.md) from the results, reads round 3's rows as
anchors by the arm each model makes (never by label), and its report words every verdict
through the verdict module."""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.round4 import plan as p
from experiments.round4 import report as rpt

S = p.FULL


def row(arm: p.Arm, seed: int, loss: float, group: str = "round4") -> dict:
    spec = p.spec_of(S, arm, seed, group)
    return {**dataclasses.asdict(spec), "model": {**spec.model, "vocab_size": 4096},
            "val_loss_causal": loss, "steps": 1, "tokens": 1, "wall_s": 60.0}  # fmt: skip


def names(results: list[dict]) -> list[str]:
    return [sp.name for sp in p.plan(S, results)]


def test_round_3s_rows_are_read_as_arms_by_their_models():
    by = {r["name"]: p.arm_key(r) for r in p.anchors(S)}
    assert by["r3-1.5e14-dense-lr4e-3-s2"] == p.Arm("dense", "XS", 4e-3)
    assert by["r3-1.5e14-mlp-s0"] == p.Arm("mlp", "S", 2e-3)  # no lr in the row: the default
    assert by["r3-1.5e14-mod-lr1e-3-s1"] == p.Arm("joint", "S", 1e-3)
    for other in ("residual", "st", "cap25", "bare"):  # outside this round's families
        assert by[f"r3-1.5e14-{other}-s0"] is None
    assert p.seeds_of(p.anchors(S), p.DENSE_XS) == pytest.approx(
        {0: 2.5680, 1: 2.5316, 2: 2.4956}, abs=1e-4
    )


def test_the_plan_starts_with_the_first_seeds_and_never_retrains_an_anchor():
    first = names([])
    assert first[:5] == [f"r4-{a.tag}-s0" for a in p.FIRST]
    assert first[5:10] == [f"r4-{a.tag}-s1" for a in p.FIRST]
    assert first[10:13] == [f"r4-{a.tag}-s2" for a in p.TUNED]
    # round 3's reruns come last (an idle worker's), seed 0, and the only anchors trained again
    reruns = [sp for sp in p.plan(S, []) if sp.group == "rerun"]
    assert [sp.name for sp in reruns] == ["r4-rerun-" + n[3:] for n in p.RERUNS]
    assert first[-len(reruns) :] == [sp.name for sp in reruns]
    anchors = {r["name"]: r for r in p.anchors(S)}
    for sp, name in zip(reruns, p.RERUNS, strict=True):  # round 3's very run, seed 0
        old = anchors[name]
        assert sp.seed == 0 and sp.model == old["model"] and sp.lr == old["lr"]
        assert (sp.budget, sp.capacity_warmup, sp.seq_len) == (
            old["budget"],
            old["capacity_warmup"],
            old["seq_len"],
        )
    assert "r4-dense-XS-lr4e-3-s1" not in first  # round 3 trained it


def test_a_rate_that_beats_4e_3_calls_for_the_next_one_up_and_the_sizes_at_it():
    better = [row(p.Arm("dense", "XS", 8e-3), s, 2.40 + s / 100) for s in (0, 1)]
    got = names(better)
    assert "r4-dense-XS-lr1.6e-2-s0" in got and "r4-dense-XS-lr1.6e-2-s1" in got
    # the best rate is no longer 4e-3: the sizes either side again at the best rate
    assert "r4-dense-S-lr8e-3-s0" in got and "r4-dense-XXS-lr8e-3-s1" in got
    worse = [row(p.Arm("dense", "XS", 8e-3), s, 2.70) for s in (0, 1)]
    assert not any("lr1.6e-2" in n or "lr8e-3" in n and "XS" not in n for n in names(worse))


def test_a_size_at_the_edge_calls_for_the_next_size_out():
    sizes = [row(p.Arm("dense", "S", 4e-3), s, 2.40) for s in (0, 1)]
    sizes += [row(p.Arm("dense", "XXS", 4e-3), s, 2.60) for s in (0, 1)]
    got = names(sizes)
    assert "r4-dense-M-lr4e-3-s0" in got and "r4-dense-XXXS-lr4e-3-s0" not in got


def test_mlp_onlys_best_rate_sets_the_rate_of_the_variants_once_its_rates_have_two_seeds():
    rates = [row(p.Arm("mlp", "S", 3e-3), s, 2.50) for s in (0,)]
    assert not any("mlp-all" in n for n in names(rates))  # 3e-3 has one seed: not yet
    rates = [row(p.Arm("mlp", "S", 3e-3), s, 2.50) for s in (0, 1)]
    rates += [row(p.Arm("mlp", "S", 4e-3, 0.1), s, 2.60) for s in (0, 1)]
    got = names(rates)
    assert {"r4-mlp-XS-lr3e-3-s0", "r4-mlp-all-S-lr3e-3-s0", "r4-mlp-all-S-lr3e-3-s1"} <= set(got)
    assert ("r4-mlp-kv-S-lr3e-3-s0" in got) == p.supported(p.Arm("mlp-kv", "S", 3e-3))


def test_an_arm_within_the_spread_of_the_bracketed_dense_gets_a_third_seed():
    close = [row(p.Arm("mlp-all", "S", 2e-3), s, 2.55) for s in (0, 1)]
    far = [row(p.Arm("mlp-all", "S", 2e-3), s, 3.10) for s in (0, 1)]
    assert "r4-mlp-all-S-lr2e-3-s2" in names(close)
    assert "r4-mlp-all-S-lr2e-3-s2" not in names(far)


def test_the_report_words_every_verdict_through_the_module_and_rewrites_byte_for_byte(
    tmp_path,
):
    results = [row(p.Arm("dense", "XS", 8e-3), s, 2.60 + s / 50) for s in (0, 1, 2)]
    rpt.write_report(results, tmp_path, S)
    first = {f: (tmp_path / f).read_bytes() for f in ("report.md", "findings.json")}
    rpt.write_report(results, tmp_path, S)
    assert first == {f: (tmp_path / f).read_bytes() for f in first}
    found = json.loads(first["findings.json"])
    words = {v["verdict"] for v in found["verdicts"].values()}
    assert words <= {"better", "worse", "within the spread", "baseline not bracketed",
                     "at the grid's edge (not measured)", "one seed (a reading)"}  # fmt: skip
    report = first["report.md"].decode()
    for v in found["verdicts"].values():
        assert v["text"] in report
    # 8e-3 is worse than 4e-3 here: 4e-3 is interior in rate, one size is still an edge
    assert found["dense"]["unbracketed"] is None and found["dense"]["edge"] == (
        "one size tried (XS)"
    )


def test_the_top_rate_is_an_edge_whatever_its_warm_up():
    """A longer warm-up at the highest rate is not a higher rate: where plain 4e-3 is best among
    MLP-only's rates, its rate is still the highest tried (not bracketed)."""
    rows = [row(p.Arm("mlp", "S", 3e-3), s, 2.60) for s in (0, 1)]
    rows += [row(p.Arm("mlp", "S", 4e-3), s, 2.30) for s in (0, 1)]
    rows += [row(p.Arm("mlp", "S", 4e-3, 0.1), s, 2.50) for s in (0, 1)]
    best, arm = rpt.optimum(rows, "mlp", "S")
    assert best == p.Arm("mlp", "S", 4e-3)
    assert arm.unbracketed is not None and "highest tried" in arm.unbracketed


def test_the_spread_by_size_is_each_sizes_seed_ranges():
    rows = [row(p.Arm("dense", "XS", 8e-3), s, x) for s, x in enumerate((2.50, 2.52, 2.49))]
    rows += [row(p.Arm("dense", "XS", 4e-3), s, x) for s, x in enumerate((2.60, 2.70))]
    rows += [row(p.Arm("mlp", "S", 3e-3), s, x) for s, x in enumerate((2.4, 2.8))]
    rows += [row(p.Arm("mlp", "S", 4e-3), 0, 2.5)]  # one seed: no range
    lines = rpt.spread_lines(rows)
    assert "| XS | 2 | 0.065 | 0.100 |" in lines  # ranges 0.03 and 0.10
    assert "| S | 1 | 0.400 | 0.400 |" in lines
    assert len(lines) == 4


def test_the_probe_table_reads_one_model_per_arm_and_names_the_arms_not_probed(tmp_path):
    dense, mlp, kv = p.Arm("dense", "XS", 8e-3), p.Arm("mlp", "S", 3e-3), p.Arm("mlp-kv", "S", 3e-3)
    rows = [row(a, s, 2.5) for a in (dense, mlp, kv) for s in (0, 1)]
    probed = [(rows[0], 0.5), (rows[1], 0.7), (rows[5], 0.1)]  # dense seeds 0, 1; kv seed 1
    (tmp_path / "probes.jsonl").write_text("".join(
        json.dumps({"name": r["name"], "repeat": {"64": {"score": x}},
                    "recall": {"64": {"score": x / 2}}}) + "\n" for r, x in probed))  # fmt: skip
    text = "\n".join(rpt.probe_table(rows, tmp_path))
    assert f"| {dense.label} | {rows[0]['name']} | +0.500 | +0.250 |" in text
    assert rows[1]["name"] not in text  # one model per arm: the lowest seed probed
    assert f"| {kv.label} | {rows[5]['name']} | +0.100 | +0.050 |" in text  # its seed 0 is gone
    assert text.endswith(f"probe has not run yet): {mlp.label}.")


def test_the_decode_table_puts_dense_first_and_shows_what_each_routed_layer_took(tmp_path):
    assert rpt.decode_table(tmp_path)[0].startswith("Not measured yet")

    def timed(pre: str, ratio: float, taken: list[float]) -> dict:
        return {f"{pre}decode_tok_s_b1": 100.0, f"{pre}decode_spread_b1": 0.02,
                f"{pre}decode_tok_s_b8": 400.0, f"{pre}decode_spread_b8": 0.05,
                f"{pre}others_busy": 0.01, f"{pre}speedup_b1": ratio,
                f"{pre}speedup_b8": ratio, f"{pre}take_b8": taken}  # fmt: skip

    rows = [
        {"name": "mlp", "run": "r4-mlp-S-lr3e-3-s0", **timed("", 1.2, [0.01, 0.02]),
         **timed("fed_", 0.9, [0.11, 0.12]), "kv_bytes_per_token_measured": 1536.0},
        {"name": "dense", "run": "r4-dense-XS-lr8e-3-s0", **timed("", 1.0, []),
         **timed("fed_", 1.0, []), "kv_bytes_per_token_measured": 1024.0},
    ]  # fmt: skip
    (tmp_path / "decode.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = rpt.decode_table(tmp_path)
    body = [line for line in table if line.startswith("| ") and "run |" not in line]
    assert [line.split(" | ")[0] for line in body] == ["| dense", "| mlp"]
    assert "| 1.20 / 1.20 | 0.90 / 0.90 | 1536 | 1.0%, 2.0% | 11.0%, 12.0% |" in body[1]
    assert body[0].endswith("| - | - |") and table[-1].endswith(
        "1% of the CPUs busy during the timings."
    )


def test_a_rerun_is_apart_from_the_first_step_whose_logged_loss_differs(tmp_path):
    def log(name: str, losses: dict[int, float]) -> object:
        path = tmp_path / name
        rows = [{"step": t, "loss": v} for t, v in losses.items()] + [{"step": 30, "val": 1.0}]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    first = log("a.jsonl", {10: 7.0, 20: 6.5, 30: 6.0})
    assert rpt.first_apart(first, log("b.jsonl", {10: 7.0, 20: 6.5})) == "none"
    assert rpt.first_apart(first, log("c.jsonl", {10: 7.0, 20: 6.5 + 6.5e-7, 30: 6.1})) == (
        "20 (by 1e-07 of it)"
    )
    assert rpt.first_apart(first, tmp_path / "gone.jsonl") == "-"
