"""A study on someone else's scheduler: its pending runs as plain ``mod train`` command lines
(or under ``torchrun``), a Slurm array script of them, and the finished runs collected back
into the study's results and report as if the study had trained them itself (`mod study
FOLDER --commands | --slurm FILE | --collect`).

A command line is `runner.prepare`'s run, every model field spelled out, so it trains exactly
what `runner.run_one` would (the tests parse it back with ``mod train``'s own parser). A study
that plans from its results (`rounds.Round`) gives the runs its results call for so far:
collect them, then ask again for the next.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

from ..config import MoDConfig
from .rounds import Round, append_row, twin, twin_row
from .runner import Plan, RunSpec, load_results, plan_runs, prepare, result_row

PRESET = "small"  # what the command names; every model field is given, so it only fills gaps
# Fields the command leaves to `mod train`: the tokenizer's vocabulary, fitted thresholds.
UNSET = {"vocab_size", "causal_thresholds"}
TRAIN_FIELDS = ("data", "tokenizer", "batch_size", "seq_len", "steps", "lr", "warmup_steps",
                "eval_every", "checkpoint_every", "eval_batches", "log_every", "seed",
                "capacity_warmup", "capacity_warmup_ratio")  # fmt: skip


def called_for(study: Any, settings: Any, results: list[dict[str, Any]]) -> list[RunSpec]:
    """Every run `study` calls for given `results`, finished ones and twins included, once each,
    in the order the study itself would train them: a round's plan, or a `Plan`'s runs and the
    second seeds of its done seed groups (`runner.plan_runs`, `runner.study`'s own order)."""
    if isinstance(study, Round):
        specs = study.plan(settings, results)
    elif isinstance(study, Plan):
        specs = list(plan_runs(study, settings, results))
    else:
        raise ValueError(f"study {getattr(study, 'name', study)!r} has no plan of runs to print")
    first: dict[str, RunSpec] = {}  # a name given twice is one run: the study trains the first
    for spec in specs:
        first.setdefault(spec.name, spec)
    return list(first.values())


def pending(study: Any, results: list[dict[str, Any]], quick: bool) -> list[RunSpec]:
    """The runs `study` calls for that have no row yet (a run whose twin finished is left to
    `collect`, which reuses the twin's row)."""
    done = {r["name"] for r in results}
    specs = called_for(study, study.settings(quick), results)
    return [sp for sp in specs if sp.name not in done and twin(sp, results) is None]


def flag_value(value: Any) -> str:
    """A field's value as its flag takes it (a tuple as comma-separated numbers)."""
    if isinstance(value, tuple):  # repr: the float back bit for bit (2.6666666666666665)
        return ",".join(repr(float(v)) for v in value)
    return repr(value) if isinstance(value, float) else str(value)


def model_flags(cfg: MoDConfig) -> list[str]:
    """Every field of `cfg` as a ``mod train`` flag over `PRESET`, at its resolved value (a
    derived one too: the command builds this model whatever the preset would derive); a None
    that the preset sets cannot be spelled as a flag and is refused."""
    base = MoDConfig.preset(PRESET)
    flags: list[str] = []
    for field, value in cfg.resolved().items():
        if field in UNSET:
            continue
        if value is None:
            preset = getattr(base, field)
            if preset is not None:
                raise ValueError(f"{field}=None cannot be given to mod train over preset "
                                 f"{PRESET!r}, which sets it to {preset!r}")  # fmt: skip
            continue
        name = "--" + field.replace("_", "-")
        if isinstance(value, bool):
            flags.append(name if value else "--no-" + field.replace("_", "-"))
        else:
            flags += [name, flag_value(value)]
    return flags


def command(
    spec: RunSpec, settings: Any, work: Path, data: str | None, torchrun: int = 0
) -> list[str]:
    """The ``mod train`` command line that trains `spec` as `runner.run_one` would, in
    ``<work>/<name>`` (resuming where a checkpoint is there); under ``torchrun`` with that many
    processes per node when `torchrun` > 0."""
    run = prepare(spec, settings, work, data)
    tc = run.train
    head = ["mod", "train"]
    if torchrun:
        head = ["torchrun", "--standalone", "--nproc_per_node", str(torchrun),
                "-m", "mixture_of_depths", "train"]  # fmt: skip
    flags = ["--preset", PRESET, *model_flags(run.model), "--out", tc.out]
    for name in TRAIN_FIELDS:
        value = getattr(tc, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), flag_value(value)]
    if not tc.calibrate:  # as `run_one` trains it: `mod train` would calibrate at the end
        flags.append("--no-calibrate")
    return [*head, *flags, "--no-progress"]


def commands(
    study: Any, out: Path, work: Path, quick: bool, data: str | None, torchrun: int = 0
) -> list[tuple[str, str]]:
    """The pending runs of `study`: (shell command line, the run's folder), one a run."""
    results = load_results(out / "results.jsonl")
    grid = grid_of(study.settings(quick))
    return [(shlex.join(command(sp, grid, work, data, torchrun)), str(work / sp.name))
            for sp in pending(study, results, quick)]  # fmt: skip


def grid_of(settings: Any) -> Any:
    """The `runner.StudySettings` a study's runs train with: a round's settings hold theirs as
    ``.grid``."""
    return getattr(settings, "grid", settings)


def slurm_script(lines: list[str], outs: list[str], name: str, log_dir: Path) -> str:
    """A Slurm array job running `lines` (each run's output folder in `outs`), one task each
    (``sbatch FILE``). A task that finds its run's checkpoint resumes it (``--resume``; a
    requeued or preempted task loses at most a checkpoint's steps), and one that finds a folder
    without a checkpoint starts it over."""
    runs = "\n".join(f"  {shlex.quote(line)}" for line in lines)
    folders = "\n".join(f"  {shlex.quote(o)}" for o in outs)
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --array=0-{max(len(lines) - 1, 0)}",
        f"#SBATCH --output={log_dir}/%x-%a.log",
        "#SBATCH --requeue",
        "set -euo pipefail",
        f"RUNS=(\n{runs}\n)",
        f"OUTS=(\n{folders}\n)",
        "CMD=${RUNS[$SLURM_ARRAY_TASK_ID]}",
        "OUT=${OUTS[$SLURM_ARRAY_TASK_ID]}",
        'if [ -e "$OUT/checkpoint" ] || [ -e "$OUT/.checkpoint.old" ]; then CMD="$CMD --resume"',
        'elif [ -e "$OUT" ]; then CMD="$CMD --overwrite"; fi',
        'eval "$CMD"',
        "",
    ])  # fmt: skip


def finished(spec: RunSpec, settings: Any, work: Path, data: str | None) -> dict | None:
    """The summary of `spec`'s run in ``<work>/<name>`` if it trained every step, else None."""
    path = work / spec.name / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    want = prepare(spec, settings, work, data).train.steps
    return summary if summary.get("steps", want) == want else None


def collect(study: Any, out: Path, work: Path, quick: bool, data: str | None) -> list[str]:
    """Append the rows of every pending run that finished in `work` (a twin's row where one
    finished), with the study's profile of each, and rewrite the report; returns the names
    collected. Repeat after each wave: a round's later runs appear as its results call."""
    s = study.settings(quick)
    grid = grid_of(s)
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    got: list[str] = []
    while True:
        results = load_results(out / "results.jsonl")
        new = _collect_wave(study, s, grid, results, out, work, data)
        got += new
        if not new:
            break
    study.report(load_results(out / "results.jsonl"), out, s)
    return got


def _collect_wave(
    study: Any, s: Any, grid: Any, results: list[dict[str, Any]], out: Path, work: Path,
    data: str | None,
) -> list[str]:  # fmt: skip
    """One pass of `collect` over the runs the results call for now, twins included (their
    rows are the twins', as `rounds.result_of` writes them)."""
    done = {r["name"] for r in results}
    got = []
    for spec in (sp for sp in called_for(study, s, results) if sp.name not in done):
        reused = twin(spec, results)
        if reused is not None:
            row = twin_row(spec, reused, out)
        else:
            summary = finished(spec, grid, work, data)
            if summary is None:
                continue
            row = result_row(prepare(spec, grid, work, data), summary, summary["train_time_s"])
            shutil.copyfile(work / spec.name / "metrics.jsonl",
                            out / "metrics" / f"{spec.name}.jsonl")  # fmt: skip
            if isinstance(study, Round):
                row.update(study.profile(spec, s, work / spec.name, data))
        append_row(out / "results.jsonl", row)
        results.append(row)
        got.append(spec.name)
    return got
