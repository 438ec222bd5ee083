"""Round 3's plan from its results, and a tiny round trained, resumed and reported: every row
holds the copy probe and the loss by place of its trained model, the report the deciding table."""

from __future__ import annotations

import dataclasses
import json

import pytest

from experiments.round3 import planning, running
from experiments.round3 import report as rpt
from experiments.round3.followup import side_of
from experiments.round3.verdicts import Grids
from mixture_of_depths.config import MoDConfig
from mixture_of_depths.studies import profiles, rounds
from mixture_of_depths.studies import verdict as vd


def _row(spec, loss: float) -> dict:
    return {**dataclasses.asdict(spec), "val_loss_causal": loss}


def _built_row(spec, loss: float) -> dict:
    """A row as the runner writes it, with the model's vocabulary, so that `rounds.twin` can
    rebuild its config."""
    return {**_row(spec, loss), "model": {**spec.model, "vocab_size": 4096}, "tokens": 1}


def _filled(spec, loss: float) -> dict:
    """A row with what the report's run table reads."""
    filler = {"tokens": 1, "steps": 1, "params": 1, "tokens_per_s": 1.0, "val_loss_topk": loss}
    return {**_built_row(spec, loss), **filler}


def test_round3_plans_each_arm_seed_by_seed_and_more_seeds_where_the_gap_closes():
    s = planning.FULL
    specs = planning.plan(s, [])
    arms = [a for a in planning.ARMS if planning.supported(a)]
    deciding = [a for a in arms if a.deciding]
    assert len(specs) == 2 * len(arms) + len(deciding)
    # the deciding arms seed by seed, then the others seed by seed
    n = 3 * len(deciding)
    assert {planning.arm_of(_row(sp, 0.0)).deciding for sp in specs[:n]} == {True}
    assert not any(planning.arm_of(_row(sp, 0.0)).deciding for sp in specs[n:])
    for part in (specs[:n], specs[n:]):
        assert [sp.seed for sp in part] == sorted(sp.seed for sp in part)
    assert specs[0].label == "dense XS" and specs[1].label.startswith("MoD S (round 2")
    for sp in specs:
        arm = planning.arm_of(_row(sp, 0.0))
        cfg = MoDConfig(**sp.model)
        assert (sp.budget, sp.seq_len, sp.batch_size, sp.evaluations) == (1.5e14, 1024, 4, 10)
        assert sp.lr == arm.lr and cfg.max_seq_len == 1024
        if arm.arch == "MoD":
            assert sp.capacity_warmup == 0.1 and cfg.causal_router == "predictor"
            assert cfg.d_model == 96 and all(getattr(cfg, k) == v for k, v in arm.over.items())
        else:
            assert sp.capacity_warmup == 0.0 and cfg.is_dense
            assert cfg.n_layers == (2 if arm.arch == "bare" else 4)
    # an arm within the dense seeds' spread of dense gets their third seed too
    st = next(a for a in arms if a.tag == "st")
    dense = [_row(planning.spec_of(s, planning.ARMS[0], sd), v) for sd, v in ((0, 2.70), (1, 2.72))]
    close = [_row(planning.spec_of(s, st, sd), 2.73) for sd in (0, 1)]
    far = [_row(planning.spec_of(s, st, sd), 3.00) for sd in (0, 1)]
    names = {sp.name for sp in planning.plan(s, dense + close)}
    assert planning.spec_of(s, st, 2).name in names
    assert planning.spec_of(s, st, 2).name not in {sp.name for sp in planning.plan(s, dense + far)}


def test_arms_the_library_cannot_build_wait_in_the_plan(monkeypatch):
    odd = planning.Arm("MoD S, something new", "new", "MoD", {"routing": "no-such-routing"})
    monkeypatch.setattr(planning, "ARMS", (*planning.ARMS, odd))
    assert not planning.supported(odd)
    assert all(sp.label != odd.label for sp in planning.plan(planning.FULL, []))


def test_lr_arms_train_apart_from_the_reference():
    s = planning.FULL
    ref = planning.spec_of(s, planning.ARMS[1], 0)
    fast = next(a for a in planning.ARMS if a.tag == "mod-lr4e-3")
    row = {**_row(ref, 3.1), "model": {**ref.model, "vocab_size": 4096}}  # as run_one writes
    assert rounds.twin(planning.spec_of(s, fast, 0), [row]) is None  # not the same run
    assert rounds.twin(ref, [row]) is row
    assert rounds.training_key(planning.spec_of(s, fast, 0)) != rounds.training_key(ref)


def test_place_edges_double_from_eight_to_the_context():
    assert profiles.place_edges(1024) == [0, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert profiles.place_edges(64) == [0, 8, 16, 32, 64]


@pytest.fixture()
def two_arms(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("MOD_CACHE_DIR", str(tmp_path / "cache"))
    data = tmp_path / "data"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.py").write_text(f"def f(x):\n    return x * {i}  # n{i}\n" * 200)
    for module in (planning, rpt):  # the plan's arms; the report's
        monkeypatch.setattr(module, "ARMS", planning.ARMS[:2])
    monkeypatch.setattr(running, "QUICK", dataclasses.replace(running.QUICK, deciding_seeds=(0,)))
    return str(data)


def test_round3_trains_resumes_and_reports(two_arms, tmp_path, monkeypatch, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    rows = running.run(out, work, quick=True, data=two_arms, progress=False)
    assert [r["label"] for r in rows] == ["dense XS", "MoD S (round 2's arm)"]
    # without a bar, a line per run: its loss, the count done and still planned, its time
    lines = [li for li in capsys.readouterr().out.splitlines() if ": causal loss " in li]
    assert [li.split(" (")[1].split(";")[0] for li in lines] == [
        "1 run done, 1 more planned so far",
        "2 runs done, 0 more planned so far",
    ]
    assert lines[0].startswith(f"{rows[0]['name']}: causal loss {rows[0]['val_loss_causal']:.4f}")
    for r in rows:
        assert r["copy_probe"]["score"] == pytest.approx(
            r["copy_probe"]["loss_first"] - r["copy_probe"]["loss_second"]
        )
        assert r["loss_by_position"]["edges"] == profiles.place_edges(64)
        evals = rpt.evaluations(out, r["name"])
        assert len(evals) >= 2 and all("copy_probe" in e for e in evals)  # at least as planned
        assert not (work / r["name"]).exists()  # the run folder went with its profile
    mod = rows[1]
    assert mod["causal_take_rate"] and rpt.last_gate(out, mod) is not None
    cal = mod["calibration"]  # fitted on one half of the windows, measured on the other
    assert len(cal["thresholds"]) == 2 and set(cal["after"]["take_rate"]) == set(
        cal["before"]["take_rate"]
    )
    assert "calibration" not in rows[0]
    for r in rows:  # how far back each layer looks: every layer once, the routed ones marked
        reach = r["attention_reach"]
        assert [c["layer"] for c in reach] == list(range(r["model"]["n_layers"]))
        assert [c["routed"] for c in reach] == [
            r["label"].startswith("MoD") and i % 2 == 1 for i in range(len(reach))
        ]
        assert all(0.0 <= c["far_share"] <= 1.0 for c in reach if c["far_share"] is not None)
    kept = work.with_name(work.name + "-kept")
    assert all((kept / r["name"] / "model.safetensors").exists() for r in rows)
    text = (out / "report.md").read_text()
    assert "## The deciding table" in text and "| dense XS | 1 |" in text
    assert "0 planned still to run" in text and (out / "round3.png").exists()
    assert "attention >= 32 back" in text and " L1r " in text
    found = json.loads((out / "findings.json").read_text())
    assert found["dense XS"]["loss"] == pytest.approx(rows[0]["val_loss_causal"])
    monkeypatch.setattr(rounds, "run_one", lambda *a, **k: pytest.fail("nothing should rerun"))
    assert len(running.run(out, work, quick=True, data=two_arms, progress=False)) == 2


def test_every_arm_against_dense_is_a_verdict_with_its_grids_open_ends(tmp_path):
    """The report words no comparison itself: each arm against dense is `verdict.compare`, with
    dense's best rate at the top of its rates (not bracketed) and one size tried on each side,
    so a difference beyond the spread is still no winner."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}
    by_tag = {"dense": (2.75, 2.72, 2.71), "mod": (3.07, 3.12, 3.09), "st": (3.07, 3.09),
              "dense-lr1e-3": (3.18, 3.14), "dense-lr4e-3": (2.57, 2.53, 2.50)}  # fmt: skip
    rows = [_filled(planning.spec_of(s, arm[t], i), v) for t, vs in by_tag.items()
            for i, v in enumerate(vs)]  # fmt: skip
    rpt.write_report(rows, tmp_path, s)
    found = json.loads((tmp_path / "findings.json").read_text())["verdicts"]
    st = found["st-vs-dense"]
    assert (st["a"], st["b"], st["verdict"]) == (arm["st"].label, "dense XS", vd.UNBRACKETED)
    assert st["paired"] == pytest.approx({"0": 0.32, "1": 0.37})
    assert "dense XS: its best rate, 4e-3, is the highest tried (1e-3, 2e-3, 4e-3)" in st["why"]
    assert "dense XS: one size tried (XS)" in st["caveats"]
    text = (tmp_path / "report.md").read_text()
    assert st["text"] in text and "beyond the seed spread" not in text
    assert found["dense-lr4e-3-vs-dense"]["verdict"] == vd.UNBRACKETED  # not "better"
    # a MoD rate within the spread of round 2's: within, whatever the means say
    rows += [
        _filled(planning.spec_of(s, arm["mod-lr4e-3"], i), x) for i, x in enumerate((3.26, 3.0))
    ]
    rpt.write_report(rows, tmp_path, s)
    found = json.loads((tmp_path / "findings.json").read_text())["verdicts"]
    assert found["mod-lr4e-3-vs-mod"]["verdict"] == vd.WITHIN


def test_a_winner_gets_its_isoflop_points_and_leading_arms_their_seeds_first(tmp_path):
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}

    def _row(spec, loss):  # as run_one writes it: the model with its vocabulary
        return {**dataclasses.asdict(spec), "model": {**spec.model, "vocab_size": 4096},
                "val_loss_causal": loss, "tokens": 1}  # fmt: skip

    first = (("dense", 2.75), ("mod", 3.07), ("mlp", 2.62), ("residual", 3.06))
    rows = [_row(planning.spec_of(s, arm[t], 0), v) for t, v in first]
    specs = planning.plan(s, rows)
    seed1 = [sp for sp in specs if sp.seed == 1]
    # the arm that closes most of the gap trains its next seed right after dense's
    assert [sp.label for sp in seed1[:2]] == [arm["dense"].label, arm["mlp"].label]
    assert not planning.follow_up(s, rows)  # one seed: no winner yet
    rows += [_row(planning.spec_of(s, arm[t], 1), v) for t, v in (("dense", 2.70), ("mlp", 2.72))]
    assert planning.winner(s, rows) == arm["mlp"]  # within dense's spread (0.05)
    follow = planning.follow_up(s, rows)
    assert {sp.budget for sp in follow} == {5e13, 1.5e14} and all(sp.seed == 0 for sp in follow)
    joint = planning.iso_spec(s, arm["mod"], 5e13, "XS", 0)  # round 2's MoD led dense there
    assert [sp.name for sp in follow if "round 2's arm" in sp.label] == [joint.name]
    for sp in follow:
        cfg = MoDConfig(**sp.model)
        if sp.label.startswith("dense"):
            assert cfg.is_dense and sp.capacity_warmup == 0.0
        else:
            want = "joint" if sp.name == joint.name else "mlp"
            assert cfg.routing == want and sp.capacity_warmup == 0.1
        assert (sp.seq_len, sp.batch_size, sp.evaluations) == (1024, 4, 10)
    # the winner at its own size and budget is the round's run again (reused, not retrained)
    own = next(sp for sp in follow if sp.budget == 1.5e14 and sp.label.startswith("MoD S,"))
    assert "routing=mlp" in own.label
    assert rounds.twin(own, rows)["name"] == planning.spec_of(s, arm["mlp"], 0).name
    # once every size at a budget ran, its best gets a second seed
    at = [sp for sp in follow if sp.budget == 5e13 and "routing=mlp" in sp.label]
    rows += [_row(sp, v) for sp, v in zip(at, (3.6, 3.4, 3.5), strict=True)]
    more = {sp.name for sp in planning.follow_up(s, rows)} - {sp.name for sp in follow}
    assert more == {planning.iso_spec(s, arm["mlp"], 5e13, "XS", 1).name}
    # the points never count as the round's arms: a dense XS at 5e13, far off the 1.5e14 arm,
    # leaves the winner, the gap and the deciding table as they were
    table = rpt.deciding_table(tmp_path, rows)[1]
    dense_pts = [sp for sp in follow if sp.budget == 5e13 and sp.label.startswith("dense")]
    rows += [_row(sp, 3.3) for sp in dense_pts]
    assert planning.winner(s, rows) == arm["mlp"]
    assert not planning.closes_the_gap(s, rows, arm["residual"])
    assert rpt.deciding_table(tmp_path, rows)[1] == table
    assert "dense XS, 5e13 FLOPs" in "\n".join(rpt.follow_up_table(rows))
    # round 2's MoD arm is a third side: judged against dense and against the winner
    rows += [_row(joint, 3.2), _row(planning.iso_spec(s, arm["mod"], 5e13, "XS", 1), 3.25)]
    text = "\n".join(rpt.follow_up_table(rows))
    assert "each side at its best: MoD XS, round 2's arm, 5e13 FLOPs against dense" in text
    assert "MoD XS, routing=mlp, 5e13 FLOPs against MoD XS, round 2's arm, 5e13 FLOPs" in text


def test_the_winners_isoflop_points_meet_dense_at_its_best_rate_once_it_has_every_seed():
    """A dense rate that beats round 2's on every seed the reference trained is dense at its
    best: the winner's points are trained beside it too, and the verdict takes the best dense
    side; with a seed missing, round 2's rate stays dense's only side."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}

    by_tag = {"dense": (2.75, 2.72, 2.71), "mod": (3.07, 3.12, 3.09), "mlp": (2.62, 2.70, 2.52),
              "dense-lr4e-3": (2.57, 2.50), "dense-lr1e-3": (3.18,)}  # fmt: skip
    rows = [_built_row(planning.spec_of(s, arm[t], i), v) for t, vs in by_tag.items()
            for i, v in enumerate(vs)]  # fmt: skip
    assert planning.winner(s, rows) == arm["mlp"]
    assert planning.best_dense(rows) == arm["dense"]  # 4e-3 lacks seed 2: not judged yet
    before = {sp.name for sp in planning.follow_up(s, rows)}
    assert not any("dense-lr" in n for n in before)
    rows.append(_built_row(planning.spec_of(s, arm["dense-lr4e-3"], 2), 2.52))
    assert planning.best_dense(rows) == arm["dense-lr4e-3"]
    follow = planning.follow_up(s, rows)
    tuned = {sp.name for sp in follow} - before
    assert tuned == {planning.iso_spec(s, arm["dense-lr4e-3"], 5e13, z, 0).name
                     for z in ("XXS", "XS")}  # fmt: skip
    for sp in (sp for sp in follow if sp.name in tuned):
        assert sp.lr == 4e-3 and MoDConfig(**sp.model).is_dense and "lr 0.004" in sp.label
    # the report's 1.5e14 verdict: the winner's best against dense's best, the tuned rate
    at = [sp for sp in follow if sp.budget == 1.5e14 and sp.name.startswith("r3-iso-")]
    rows += [_built_row(sp, 2.9) for sp in at if not rounds.twin(sp, rows)]
    text = "\n".join(rpt.follow_up_table(rows))
    assert "dense XS, lr 4e-3 |" in text
    # (the winner at its own size is the round's arm here: no reused point was written)
    assert f"each side at its best: {arm['mlp'].label} against dense XS, lr 4e-3:" in text


def test_every_rate_of_a_variant_that_closes_the_gap_gets_the_deciding_seeds():
    """MLP-only routing closes the gap at 2e-3; its verdict against a tuned dense is taken at its
    best rate, so its 4e-3 arm gets a third seed, with the deciding runs; round 2's MoD arm's
    rates, which close nothing, keep two."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}
    by_tag = {"dense": (2.75, 2.72, 2.71), "mod": (3.07, 3.12, 3.09), "mlp": (2.62, 2.70, 2.52),
              "mlp-lr4e-3": (3.21, 2.48), "mod-lr4e-3": (3.26, 3.00)}  # fmt: skip
    rows = [_row(planning.spec_of(s, arm[t], i), v) for t, vs in by_tag.items()
            for i, v in enumerate(vs)]  # fmt: skip
    names = [sp.name for sp in planning.plan(s, rows)]
    third = planning.spec_of(s, arm["mlp-lr4e-3"], 2).name
    assert third in names and planning.spec_of(s, arm["mod-lr4e-3"], 2).name not in names
    assert names.index(third) < names.index(planning.spec_of(s, arm["st"], 0).name)
    rows = [r for r in rows if r["label"] != arm["mlp"].label]  # the variant not yet judged
    assert third not in {sp.name for sp in planning.plan(s, rows)}


def test_the_winners_isoflop_points_come_before_the_other_arms_later_seeds():
    """Once a winner has its deciding seeds, its isoFLOP points test the conclusion; a second
    seed of an arm whose first closed little of the gap only repeats a reading, so it waits.
    Every arm's first seed still comes before the points."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}

    by_tag = {"dense": (2.75, 2.72, 2.71), "mod": (3.07, 3.12, 3.09), "mlp": (2.62, 2.70, 2.52),
              "dense-lr4e-3": (2.57, 2.53, 2.50), "mlp-lr4e-3": (3.21, 2.48, 2.41)}  # fmt: skip
    rows = [_built_row(planning.spec_of(s, arm[t], i), v) for t, vs in by_tag.items()
            for i, v in enumerate(vs)]  # fmt: skip
    names = [sp.name for sp in planning.plan(s, rows)]
    points = [sp.name for sp in planning.follow_up(s, rows) if not rounds.twin(sp, rows)]
    assert points and set(points) <= set(names)
    st0, st1 = (planning.spec_of(s, arm["st"], i).name for i in (0, 1))
    assert names.index(st0) < min(map(names.index, points)) < names.index(st1)
    # with every first seed and every deciding seed in, the points are next
    done = {r["name"] for r in rows}
    rows += [_built_row(sp, 3.07) for sp in planning.plan(s, rows)
             if sp.name not in {*points, *done}
             and (sp.seed == 0 or planning.arm_of({"label": sp.label}).deciding)]  # fmt: skip
    done = {r["name"] for r in rows}
    pending = [sp.name for sp in planning.plan(s, rows)
               if sp.name not in done and not rounds.twin(sp, rows)]  # fmt: skip
    assert pending[: len(points)] == points and st1 in pending


def test_a_better_dense_rate_is_the_reference_at_its_best_not_a_variant():
    """A dense learning rate that beats the reference closes no gap and never leads (its seeds
    would crowd out the MoD runs that ask whether MoD gains from a rate too), but as the reference
    at its best it gets the deciding seeds; within a seed the lr arms come first."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}
    rows = [
        {**dataclasses.asdict(planning.spec_of(s, arm[t], seed)), "val_loss_causal": v}
        for t, by_seed in (("dense", (2.75, 2.72, 2.71)), ("mod", (3.07, 3.12, 3.09)),
                           ("dense-lr4e-3", (2.57,)), ("st", (3.07,)))
        for seed, v in enumerate(by_seed)
    ]  # fmt: skip
    assert not planning.leading(rows, arm["dense-lr4e-3"])
    names = [sp.name for sp in planning.plan(s, rows)]

    def at(tag, seed):
        return names.index(planning.spec_of(s, arm[tag], seed).name)

    assert at("mod-lr4e-3", 0) < at("mlp-lr4e-3", 0) < at("dense-lr4e-3", 1)  # not seed 1 first
    assert at("mod-lr4e-3", 1) < at("st", 1)  # the lr arms first within a seed
    # the reference at its best: its seeds once every arm has its first, before other seeds
    assert max(at(t, 0) for t in ("st", "cap25", "mod-lr1e-3")) < at("dense-lr4e-3", 1)
    assert at("dense-lr4e-3", 2) < min(at(t, 1) for t in ("dense-lr1e-3", "mod-lr4e-3", "st"))
    assert planning.spec_of(s, arm["dense-lr4e-3"], 2).name in names
    assert planning.spec_of(s, arm["dense-lr1e-3"], 2).name not in names
    # a MoD rate that beats dense the same way is a variant that closes the gap: it leads
    rows.append({**dataclasses.asdict(planning.spec_of(s, arm["mod-lr4e-3"], 0)),
                 "val_loss_causal": 2.70})  # fmt: skip
    assert planning.leading(rows, arm["mod-lr4e-3"])
    names = [sp.name for sp in planning.plan(s, rows)]
    assert at("mod-lr4e-3", 1) < min(at("mod", 1), at("mlp-lr4e-3", 0))  # with the deciding runs


def test_an_arm_closes_the_gap_of_its_own_seeds():
    """One seed of an arm is judged against MoD's and dense's same seed (the same data order
    and initial weights), not their means over seeds it did not train."""
    from experiments.round3.report import gap_closed

    mod = {"by_seed": {0: 3.0, 1: 3.2}}
    dense = {"by_seed": {0: 2.7, 1: 2.7}}
    assert gap_closed({"by_seed": {0: 2.85}}, mod, dense) == pytest.approx(0.5)  # not 0.625
    assert gap_closed({"by_seed": {0: 2.85, 1: 2.95}}, mod, dense) == pytest.approx(0.5)
    assert gap_closed({"by_seed": {2: 2.85}}, mod, dense) is None  # no seed in common
    assert gap_closed({"by_seed": {0: 2.5}}, {"by_seed": {0: 2.6}}, dense) is None  # no gap


def test_a_best_size_is_picked_on_the_seeds_every_size_trained_and_one_seed_is_a_reading():
    """A size with one seed is not held against another's mean over three: the best is picked
    on the seed they share (`best_of`), and their difference is a reading, not a verdict."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}
    by_tag = {"dense": (2.75, 2.72, 2.71), "mod": (3.07, 3.12, 3.09), "mlp": (2.62, 2.70, 2.52)}
    rows = [_built_row(planning.spec_of(s, arm[t], i), v) for t, vs in by_tag.items()
            for i, v in enumerate(vs)]  # fmt: skip
    # XS below S's mean over three seeds (2.6133), above S's seed 0 (2.62): S stays best
    for size, loss in (("XS", 2.65), ("M", 3.17)):
        rows.append(_built_row(planning.iso_spec(s, arm["mlp"], s.budget, size, 0), loss))
    verdicts: dict = {}
    text = "\n".join(rpt.follow_up_table(rows, s, verdicts))
    assert "its best size, S, is interior to those tried (XS, S, M), on seed 0, the one" in text
    xs = verdicts["iso-1.5e14-mlp-xs-vs-s"]
    assert xs.word == vd.ONE_SEED and xs.diff == pytest.approx(0.03)  # not 2.65 - 2.6133
    assert xs.text() in text


def test_the_gap_closed_names_the_seeds_it_stands_on(tmp_path):
    """An arm with three seeds against a MoD with two closes the gap on the two they share,
    and the report says two, not three."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}
    losses = {"dense": (2.75, 2.72, 2.71), "mod": (3.07, 3.12), "mlp": (2.62, 2.70, 2.52)}
    filler = {"tokens": 1, "steps": 1, "params": 1, "tokens_per_s": 1.0}
    rows = [
        {**dataclasses.asdict(sp), "model": {**sp.model, "vocab_size": 4096},
         "val_loss_causal": v, "val_loss_topk": v, **filler}
        for tag, vs in losses.items()
        for seed, v in enumerate(vs)
        for sp in [planning.spec_of(s, arm[tag], seed)]
    ]  # fmt: skip
    rpt.write_report(rows, tmp_path, s)
    line = next(li for li in (tmp_path / "report.md").read_text().splitlines()
                if li.startswith(f"- {arm['mlp'].label}: closes"))  # fmt: skip
    mod, dense, mlp = (sum(losses[t][:2]) / 2 for t in ("mod", "dense", "mlp"))
    assert f"closes {(mod - mlp) / (mod - dense):.0%} of the gap on the 2 seeds it shares" in line


def test_each_architecture_is_compared_at_its_best_learning_rate():
    """Whether round 2 compared untuned arms: the best of each architecture's learning rates
    (`best_of`, on the seeds every rate trained) against the other's best, not the reference
    pair; a best at the end of the rates tried is named as not bracketed."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}

    def said(by_tag: dict) -> tuple[list[str], dict]:
        rows = [_built_row(planning.spec_of(s, arm[t], i), x) for t, xs in by_tag.items()
                for i, x in enumerate(xs)]  # fmt: skip
        verdicts: dict = {}
        lines = rpt.learning_rates(Grids(rows, s), rpt.by_arm(rows), s, verdicts)
        return lines, verdicts

    by_tag = {"dense": (2.70, 2.72), "mod": (3.10, 3.12)}
    assert said(by_tag) == ([], {})  # no lr arm yet: nothing to say
    by_tag |= {"dense-lr1e-3": (3.20, 3.22), "mod-lr4e-3": (2.60, 2.62)}
    lines, verdicts = said(by_tag)
    best = verdicts["mod-vs-dense-best-rates"]
    assert (best.a.label, best.b.label) == ("MoD S, lr 4e-3", "dense XS")
    assert best.diff == pytest.approx(-0.10) and best.word == vd.UNBRACKETED
    assert "MoD S, lr 4e-3: its best rate, 4e-3, is the highest tried (2e-3, 4e-3)" in best.why
    assert "dense XS: its best rate, 2e-3, is the highest tried (1e-3, 2e-3)" in best.why
    assert f"- each at its best learning rate of those tried: {best.text()}" in lines
    # a variant with lr arms in the plan is held to dense's best too, even before its own run
    by_tag |= {"mlp": (2.66, 2.68), "dense-lr4e-3": (2.50, 2.52)}
    _, verdicts = said(by_tag)
    assert verdicts["mod-vs-dense-best-rates"].diff == pytest.approx(0.10)
    mlp = verdicts["mlp-vs-dense-best-rates"]
    assert mlp.b.label == "dense XS, lr 4e-3" and mlp.diff == pytest.approx(0.16)
    assert "one rate tried (2e-3)" in mlp.why
    by_tag["mlp-lr4e-3"] = (2.40, 2.42)
    _, verdicts = said(by_tag)
    mlp = verdicts["mlp-vs-dense-best-rates"]
    assert mlp.a.label == "MoD S, routing=mlp, lr 4e-3" and mlp.diff == pytest.approx(-0.10)


def test_a_reused_isoflop_point_is_judged_on_every_seed_its_arm_trained():
    """The winner at its own size and budget is planned with two seeds and reused from the
    round's arm (``same_run_as``); the arm has a third: the point's verdict uses all three,
    as the deciding table does."""
    s = planning.FULL
    arm = {a.tag: a for a in planning.ARMS}
    by_tag = {"dense": (2.75, 2.72, 2.71), "mod": (3.07, 3.12, 3.09), "mlp": (2.62, 2.70, 2.52)}
    rows = [_built_row(planning.spec_of(s, arm[t], i), v) for t, vs in by_tag.items()
            for i, v in enumerate(vs)]  # fmt: skip
    for seed in (0, 1):  # as the runner writes a reused run
        point = planning.iso_spec(s, arm["mlp"], s.budget, "S", seed)
        own = rows[6 + seed]
        assert rounds.twin(point, rows) is own
        rows.append({**own, "name": point.name, "label": point.label, "group": point.group,
                     "same_run_as": own["name"]})  # fmt: skip
    text = "\n".join(rpt.follow_up_table(rows))
    assert f"| {point.label} | 3 | 2.6200, 2.7000, 2.5200 | 2.6133 |" in text


def _profile(far: float, end: float) -> dict:
    """A loss by place: 4.5 on the first places, `far` at places 32-63, `end` at the last."""
    return {"edges": [0, 8, 16, 32, 64, 1024], "loss": [4.5, 3.6, 3.3, far, end]}


def test_late_fall_is_the_drop_from_place_32_to_the_last_bucket():
    from experiments.round3.mechanism import late_fall

    assert late_fall({"loss_by_position": _profile(2.9, 2.7)}) == pytest.approx(0.2)
    assert late_fall({"loss_by_position": _profile(3.0, 3.05)}) == pytest.approx(-0.05)
    assert late_fall({}) is None
    short = {"edges": [0, 8, 16], "loss": [4.0, 3.0]}  # a context that never reaches place 32
    assert late_fall({"loss_by_position": short}) is None


def _mechanism_report(
    tmp_path, arms: dict[str, tuple[tuple[float, float, float], ...]]
) -> list[str]:
    """The report's "What the round says" for rows of (loss, loss at place 32, at the end)."""
    s = planning.FULL
    by_tag = {a.tag: a for a in planning.ARMS}
    filler = {"tokens": 1, "steps": 1, "params": 1, "tokens_per_s": 1.0}
    rows = [
        {**dataclasses.asdict(sp), "model": {**sp.model, "vocab_size": 4096},
         "val_loss_causal": v, "val_loss_topk": v, "loss_by_position": _profile(far, end),
         **filler}
        for tag, seeds in arms.items()
        for seed, (v, far, end) in enumerate(seeds)
        for sp in [planning.spec_of(s, by_tag[tag], seed)]
    ]  # fmt: skip
    rpt.write_report(rows, tmp_path, s)
    text = (tmp_path / "report.md").read_text()
    says = text[text.index("## What the round says") : text.index("Conclusion")]
    return [*says.split("\n- ")[1:], text[text.index("Conclusion") :].splitlines()[0]]


def test_the_round_names_isolation_only_where_an_arm_closes_the_gap_and_keeps_looking_back(
    tmp_path,
):
    """The issue's rule: isolation blocks look-back where residual KV or MLP-only routing closes
    most of the gap on two seeds *and* its loss keeps falling past place 32; closing it flat
    (a better short-context model) is not look-back, and one seed decides nothing."""
    dense = ((2.70, 2.90, 2.70), (2.72, 2.92, 2.70))  # falls 0.2 past place 32
    mod = ((3.10, 3.05, 3.05), (3.12, 3.07, 3.07))  # flat
    flat_closer = ((2.80, 2.85, 2.84), (2.82, 2.87, 2.86))  # closes 75%, flat
    *isolation, gates, rate, conclusion = _mechanism_report(
        tmp_path / "a", {"dense": dense, "mod": mod, "residual": flat_closer,
                         "mlp": flat_closer[:1], "st": ((2.70, 2.9, 2.7),)},
    )  # fmt: skip
    assert isolation[0].startswith("**isolation of the routed layers blocks look-back: undecided")
    assert ": no, closes 75% of the gap (2 seeds)" in isolation[0]
    assert "one seed decides nothing" in isolation[0] and "one seed decides nothing" in gates
    assert "undecided" in rate and conclusion.startswith(
        "Conclusion, by the round's rule: not decided"
    )
    looks_back = ((2.80, 2.95, 2.80), (2.82, 2.97, 2.82))  # closes 75%, falls 0.15
    *isolation, gates, rate, conclusion = _mechanism_report(
        tmp_path / "b", {"dense": dense, "mod": mod, "residual": flat_closer, "mlp": looks_back},
    )  # fmt: skip
    assert isolation[0].startswith("**isolation of the routed layers blocks look-back: holds")
    assert (
        conclusion
        == "Conclusion, by the round's rule: isolation of the routed layers blocks look-back."
    )


def test_the_round_says_depth_only_when_every_hypothesis_was_tested_and_failed(tmp_path):
    dense = ((2.70, 2.90, 2.70), (2.72, 2.92, 2.70))
    mod = ((3.10, 3.05, 3.05), (3.12, 3.07, 3.07))
    near_mod = ((3.05, 3.05, 3.05), (3.07, 3.07, 3.07))  # closes 12%, flat
    arms = {
        "dense": dense,
        "mod": mod,
        "residual": near_mod,
        "mlp": near_mod,
        "st": near_mod,
        "dense-lr4e-3": ((2.60, 2.8, 2.6), (2.62, 2.82, 2.6)),
        "mod-lr4e-3": near_mod,
    }
    *_, gates, rate, conclusion = _mechanism_report(tmp_path / "a", arms)
    assert rate.startswith("**tuning the learning rate closes the gap: does not hold")
    assert "+0.4500 nats, against +0.4000 for round 2's untuned pair" in rate  # tuning widens it
    # each arm against dense, as a verdict of the verdict module, beside the rule's numbers
    assert "MoD S, lr 4e-3 against dense XS, lr 4e-3: +0.4500 nats (seeds 0, 1: " in rate
    assert "MoD S, straight-through gate against dense XS: +0.3500 nats (seeds 0, 1: " in gates
    assert conclusion.startswith("Conclusion, by the round's rule: none of the three: it is depth")
    # the same, but MoD at 4e-3 closes most of round 2's gap: the learning rate holds instead
    arms["mod-lr4e-3"] = ((2.80, 3.0, 3.0), (2.82, 3.02, 3.02))
    *_, rate, conclusion = _mechanism_report(tmp_path / "b", arms)
    assert rate.startswith("**tuning the learning rate closes the gap: holds")
    assert conclusion == "Conclusion, by the round's rule: tuning the learning rate closes the gap."


def test_an_isoflop_row_is_on_its_arms_side_whatever_its_label_says():
    """The side comes from the arm's tag in the run's name, not from the label's wording."""
    side = {name: side_of({"name": name, "label": "MoD S, renamed"}) for name in (
        "r3-iso-5e13-mod-XS-s0", "r3-iso-5e13-mlp-XXS-s1", "r3-iso-5e13-dense-lr4e-3-XS-s1",
        "r3-1.5e14-mlp-s2", "r3-1.5e14-mod-s0", "r3-1.5e14-dense-s1")}  # fmt: skip
    assert side == {
        "r3-iso-5e13-mod-XS-s0": "joint", "r3-iso-5e13-mlp-XXS-s1": "winner",
        "r3-iso-5e13-dense-lr4e-3-XS-s1": "dense", "r3-1.5e14-mlp-s2": "winner",
        "r3-1.5e14-mod-s0": "joint", "r3-1.5e14-dense-s1": "dense",
    }  # fmt: skip
    with pytest.raises(ValueError, match="no round 3 arm has the tag 'nope'"):
        side_of({"name": "r3-iso-5e13-nope-XS-s0"})
    s = planning.FULL  # every arm read back from the names the plan gives its runs
    for arm in planning.ARMS:
        for name in (
            planning.spec_of(s, arm, 2).name,
            planning.iso_spec(s, arm, 5e13, "XXS", 1).name,
        ):
            assert planning.arm_of_run(name) is arm
