"""A study on another scheduler: its runs as `mod train` command lines that train exactly what
the study would, a Slurm array script that resumes a requeued run, and the finished runs
collected back into the study's results as if it had trained them."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mixture_of_depths import cli
from mixture_of_depths.cli import train as cli_train
from mixture_of_depths.studies import loader, runner, scheduler
from mixture_of_depths.studies.rounds import Round
from mixture_of_depths.studies.runner import (
    Folders,
    Plan,
    RunSpec,
    StudySettings,
    load_results,
    prepare,
    run_one,
)

STUDY = """
from pathlib import Path

from mixture_of_depths.studies.runner import Folders, Plan, RunSpec, StudySettings

SHAPE = dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, predictor_hidden=8)
SETTINGS = StudySettings(budgets=(2e8,), sizes=(("S", SHAPE),), seq_len=32, batch_size=4,
                         eval_every_runs=1, eval_batches=1, base={}, ablation_size="S",
                         tokenizer="bpe")


def runs(s):
    return [
        RunSpec(name="dense-s0", group="ablation", label="dense", budget=2e8,
                model={**SHAPE, "layer_pattern": "D"}, lr=3e-3),
        RunSpec(name="mod-s1", group="ablation", label="MoD", budget=2e8, seed=1,
                model={**SHAPE, "layer_pattern": "DR", "ff_mult": 2.0, "capacity": 0.29},
                capacity_warmup=0.5, lr_warmup=0.25),
    ]


STUDY = Plan(name="tiny", settings=lambda quick: SETTINGS, runs=runs,
             report=lambda results, out, s: (out / "report.md").write_text(str(len(results))),
             folders=Folders(str(Path(__file__).parent)))
"""


@pytest.fixture()
def tiny_study(tmp_path: Path, corpus: Path) -> tuple[Path, str]:
    folder = tmp_path / "tiny_study"
    folder.mkdir()
    (folder / "__init__.py").write_text(STUDY)
    return folder, str(corpus)


def test_a_command_line_trains_exactly_what_the_study_would(tiny_study, tmp_path, monkeypatch):
    folder, data = tiny_study
    study = loader.load_study(folder)
    s = study.settings(False)
    got = []
    monkeypatch.setattr(cli_train, "train", lambda cfg, tc, **kw: got.append((cfg, tc)) or {})
    monkeypatch.setattr(cli_train, "format_summary", lambda summary: "")
    for spec in study.runs(s):
        line = scheduler.command(spec, s, tmp_path / "work", data)
        assert line[:2] == ["mod", "train"]
        assert cli.main(shlex.split(shlex.join(line))[1:]) == 0  # through the shell's quoting
        cfg, tc = got.pop()
        want = prepare(spec, s, tmp_path / "work", data)
        # the vocabulary is the tokenizer's: training sets it, the command leaves it out
        assert dataclasses.replace(cfg, vocab_size=want.model.vocab_size) == want.model
        assert tc == want.train
    torch_line = scheduler.command(study.runs(s)[0], s, tmp_path / "work", data, torchrun=4)
    assert torch_line[:6] == ["torchrun", "--standalone", "--nproc_per_node", "4", "-m",
                              "mixture_of_depths"]  # fmt: skip


def test_runs_trained_elsewhere_are_collected_as_the_study_would_have_written_them(
    tiny_study, tmp_path, capsys
):
    folder, data = tiny_study
    out, work = tmp_path / "out", tmp_path / "work"
    args = ["study", str(folder), "--out", str(out), "--work", str(work), "--data", data]
    assert cli.main([*args, "--commands"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    mod = [sys.executable, "-m", "mixture_of_depths"]
    subprocess.run([*mod, *shlex.split(lines[0])[1:]], check=True, env=env, capture_output=True)
    assert cli.main([*args, "--collect"]) == 0  # one of two finished: it alone comes back
    assert [r["name"] for r in load_results(out / "results.jsonl")] == ["dense-s0"]
    assert cli.main([*args, "--commands"]) == 0  # what is left to run
    rest = capsys.readouterr().out.splitlines()
    assert rest[-1] == lines[1]
    subprocess.run([*mod, *shlex.split(lines[1])[1:]], check=True, env=env, capture_output=True)
    assert cli.main([*args, "--collect"]) == 0
    rows = {r["name"]: r for r in load_results(out / "results.jsonl")}
    assert (out / "report.md").read_text() == "2" and (out / "metrics" / "mod-s1.jsonl").exists()
    # the oracle: the study's own runner trains the same spec to the same row
    study = loader.load_study(folder)
    s = study.settings(False)
    for spec in study.runs(s):
        mine = run_one(spec, s, tmp_path / "here", data)
        theirs = rows[spec.name]
        for key in ("val_loss_causal", "val_loss_topk", "steps", "tokens", "model", "lr",
                    "lr_warmup", "capacity_warmup", "flops_budget_used"):  # fmt: skip
            assert theirs[key] == mine[key], key


def test_the_slurm_script_runs_one_task_each_and_resumes_a_requeued_run(tmp_path):
    lines = ["mod train --out A --seed 0", "mod train --out 'B C' --seed 1"]
    outs = [str(tmp_path / "A"), str(tmp_path / "B C")]
    script = tmp_path / "job.sh"
    script.write_text(scheduler.slurm_script(lines, outs, "tiny", tmp_path))
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "mod").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$CALLED"\n')
    (stub / "mod").chmod(0o755)
    (tmp_path / "B C" / "checkpoint").mkdir(parents=True)  # task 1 was preempted

    def task(i: int) -> list[str]:
        called = tmp_path / f"called{i}"
        env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}",
               "SLURM_ARRAY_TASK_ID": str(i), "CALLED": str(called)}  # fmt: skip
        subprocess.run(["bash", str(script)], check=True, env=env)
        return called.read_text().splitlines()

    assert task(0) == ["train", "--out", "A", "--seed", "0"]
    assert task(1) == ["train", "--out", "B C", "--seed", "1", "--resume"]
    assert "#SBATCH --array=0-1" in script.read_text()


def test_a_loop_study_has_no_runs_to_print(tmp_path, capsys):
    folder = tmp_path / "loop_study"
    folder.mkdir()
    (folder / "__init__.py").write_text(
        "from mixture_of_depths.studies.runner import Folders, Loop\n"
        "STUDY = Loop('x', Folders('.'), lambda *a: 0)\n"
    )
    assert cli.main(["study", str(folder), "--commands"]) == 2
    assert "runs a loop of its own" in capsys.readouterr().err


EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.mark.parametrize("name", ["kv", "mor"])
def test_pending_proposes_the_second_seeds_the_plans_own_seeding_gives(name, tmp_path, monkeypatch):
    """With the committed results less their seed-1 rows, the scheduler proposes exactly the
    runs `runner.study` would train next, in its order (the oracle: `runner.study` itself, each
    run answered by its committed row instead of training), and those are the committed seed-1
    runs."""
    plan = loader.load_study(EXPERIMENTS / name)
    committed = load_results(EXPERIMENTS / name / "results.jsonl")
    first = [r for r in committed if r["seed"] != 1]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    rows = {r["name"]: r for r in committed}
    trained: list[str] = []
    monkeypatch.setattr(
        runner, "run_one", lambda spec, *a: trained.append(spec.name) or rows[spec.name]
    )
    quiet = dataclasses.replace(plan, report=lambda *a: None, finish=None)
    runner.study(quiet, tmp_path, tmp_path / "work", progress=False)
    proposed = [sp.name for sp in scheduler.pending(plan, first, False)]
    assert proposed == trained
    assert sorted(proposed) == sorted(r["name"] for r in committed if r["seed"] == 1)


def _row(spec: RunSpec, **extra: Any) -> dict[str, Any]:
    return {**dataclasses.asdict(spec), "val_loss_causal": 3.0, **extra}


def _twins() -> tuple[RunSpec, RunSpec]:
    model = {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32, "vocab_size": 64,
             "causal_router": "predictor"}  # fmt: skip
    a = RunSpec(name="a", group="ablation", label="A", budget=1e8, model=model)
    return a, dataclasses.replace(a, name="b", label="B", evaluations=3)


def _collect_twin(study: Any, tmp_path: Path, a: RunSpec) -> dict[str, dict[str, Any]]:
    out = tmp_path / "out"
    (out / "metrics").mkdir(parents=True)
    (out / "metrics" / "a.jsonl").write_text('{"step": 1}\n')
    (out / "results.jsonl").write_text(json.dumps(_row(a, profile={"x": 1})) + "\n")
    assert scheduler.collect(study, out, tmp_path / "work", False, None) == ["b"]
    assert (out / "metrics" / "b.jsonl").read_text() == '{"step": 1}\n'
    return {r["name"]: r for r in load_results(out / "results.jsonl")}


def test_a_twin_collected_for_a_round_gets_the_row_the_round_itself_writes(tmp_path):
    """A run whose twin finished is collected with the row `rounds.result_of` gives it: its own
    evaluations, no profile of the other run's."""
    a, b = _twins()
    settings = SimpleNamespace(grid=None)
    study = Round(name="r", folders=Folders(str(tmp_path)), settings=lambda quick: settings,
                  plan=lambda s, results: [a, b], report=lambda *args: None,
                  profile=lambda *args: {})  # fmt: skip
    rows = _collect_twin(study, tmp_path, a)
    assert rows["b"]["same_run_as"] == "a" and rows["b"]["evaluations"] == 3
    assert "profile" not in rows["b"] and rows["a"]["profile"] == {"x": 1}


def test_a_twin_in_a_plan_is_collected(tmp_path):
    """A plan's run whose twin finished is neither printed nor left out: collect reuses the
    twin's row."""
    a, b = _twins()
    settings = StudySettings(budgets=(1e8,), sizes=(), seq_len=32, batch_size=4, eval_every_runs=1,
                             eval_batches=1, base={}, ablation_size="S")  # fmt: skip
    study = Plan(name="p", settings=lambda quick: settings, runs=lambda s: [a, b],
                 report=lambda *args: None, folders=Folders(str(tmp_path)))  # fmt: skip
    assert scheduler.pending(study, [_row(a)], False) == []
    rows = _collect_twin(study, tmp_path, a)
    assert rows["b"]["same_run_as"] == "a" and rows["b"]["evaluations"] == 3
