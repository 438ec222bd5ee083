"""Studies that plan their next runs from their own results (the second and third rounds), run
by one process or several at once on the same folders (`mod study --workers`): each claims the
next run nobody holds, records its row under a lock and rewrites the report after each.

A `Round` names what differs between them: the settings, the plan, the report, the default
folders, and what is measured of each trained model before its folder is deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..config import MoDConfig
from ..fileio import json_text
from ..runtime.runlock import RunLock, RunLockedError
from .runner import Folders, RunSpec, finished_line, load_results, run_one


@dataclass(frozen=True)
class Round:
    """A study that plans from its results: `settings(quick)` (with ``.grid``, the
    `StudySettings` its runs train with), `plan(settings, results)` (every run the results so
    far call for, done ones included), `report(results, out, settings)`, its default folders,
    and `profile(spec, settings, folder, data)`: what to add to a run's row from its trained
    folder (its checkpoint) before the folder is deleted."""

    name: str
    folders: Folders
    settings: Callable[[bool], Any]
    plan: Callable[[Any, list[dict[str, Any]]], list[RunSpec]]
    report: Callable[[list[dict[str, Any]], Path, Any], None]
    profile: Callable[[RunSpec, Any, Path, str | None], dict[str, Any]]


def run(
    study: Round,
    out: str | Path | None = None,
    work: str | Path | None = None,
    quick: bool = False,
    data: str | None = None,
    progress: bool = True,
    max_runs: int | None = None,
    worker: int | None = None,
    poll_s: float = 10.0,
) -> list[dict[str, Any]]:
    """Run (or resume) `study`; returns all results and rewrites the report after each
    run. `max_runs` stops after that many new runs (a slice of the study, resumable).

    Several processes may run it at once on the same `out` and `work` (`mod study --workers`):
    each claims the next run nobody holds (a lock per training run under ``<work>/.claims``,
    so twins (`twin`) never train twice either; the kernel drops it if its process dies),
    appends its row under a lock, and waits while every run the results call for so far is
    another worker's (their rows may call for more). A worker may finish a second seed that a
    seed landing meanwhile took out of the plan (`_bracket` reads second seeds): its row is
    kept, one more seed. `max_runs` counts this process's runs; `worker` names this process
    in the one line it prints per finished run."""
    s = study.settings(quick)
    out = Path(out if out is not None else study.folders.out_for(quick))
    work = Path(work if work is not None else study.folders.work_for(quick))
    (out / "metrics").mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    claims = work / ".claims"
    results = load_results(results_path)
    if not worker:  # one line before any work (--quick is no minute's smoke run either)
        called = {sp.name for sp in study.plan(s, results)} - {r["name"] for r in results}
        print(f"{study.name}: {len(called)} runs to train, {len(results)} done; the plan may "
              "call for more as results come in", file=sys.stderr)  # fmt: skip
    bar = tqdm(desc=study.name, unit="run", initial=len(results), disable=not progress)
    new = 0
    while max_runs is None or new < max_runs:
        results[:] = load_results(results_path)  # with the other workers' rows
        done = {r["name"] for r in results}
        pending = [sp for sp in study.plan(s, results) if sp.name not in done]
        if not pending:
            break
        held, spec = claim_next(claims, pending)
        if held is None:  # all of them another worker's
            time.sleep(poll_s)
            continue
        try:  # released however the run ends; the kernel drops it if the process dies
            results[:] = load_results(results_path)
            if spec.name in {r["name"] for r in results}:
                continue  # finished by another worker between our reading and our claim
            bar.total = len(done) + len(pending)
            bar.set_postfix_str(spec.name)
            started = time.monotonic()
            row, folder = result_of(study, spec, s, results, out, work, data, progress)
            with waiting_lock(claims, "results"):  # one writer of the file and the report
                append_row(results_path, row)
                results[:] = load_results(results_path)
                study.report(results, out, s)
            bar.update(1)
            if worker is not None or not progress:  # where no bar shows it
                who = "" if worker is None else f"[worker {worker}] "
                names = {r["name"] for r in results}  # every worker's rows, this one's too
                to_go = sum(sp.name not in names for sp in study.plan(s, results))
                took = time.monotonic() - started
                print(who + finished_line(row, len(names), to_go, took), flush=True)
            if folder is not None:  # trained here, not reused
                new += 1
                shutil.rmtree(folder, ignore_errors=True)
        finally:
            held.release()
    bar.close()
    with waiting_lock(claims, "results"):
        results[:] = load_results(results_path)
        study.report(results, out, s)
    with contextlib.suppress(OSError):
        claims.rmdir()  # empty once no worker holds anything
    return results


def result_of(
    study: Round,
    spec: RunSpec,
    s: Any,
    results: list[dict[str, Any]],
    out: Path,
    work: Path,
    data: str | None,
    progress: bool,
) -> tuple[dict[str, Any], Path | None]:
    """`spec`'s result row, with its metrics copied to ``<out>/metrics`` and `study.profile`'s
    fields, and the run folder it trained in (None where a finished twin's row is reused)."""
    done = twin(spec, results)
    if done is not None:  # the same run, already done under another name: reuse it
        return twin_row(spec, done, out), None
    row = run_one(spec, s.grid, work, data, progress)
    folder = work / spec.name
    shutil.copyfile(folder / "metrics.jsonl", out / "metrics" / f"{spec.name}.jsonl")
    row.update(study.profile(spec, s, folder, data))
    return row, folder


def twin_row(spec: RunSpec, done: dict[str, Any], out: Path) -> dict[str, Any]:
    """`spec`'s row from the row `done` of its finished `twin`, its metrics copied in ``<out>/
    metrics`` under `spec`'s name: the training's figures are the twin's; `spec`'s own are its
    name, group, label and evaluations, and no profile (one is of the twin's evaluations)."""
    row = {**done, "name": spec.name, "group": spec.group, "label": spec.label,
           "evaluations": spec.evaluations, "same_run_as": done["name"]}  # fmt: skip
    row.pop("profile", None)
    shutil.copyfile(out / "metrics" / f"{done['name']}.jsonl",
                    out / "metrics" / f"{spec.name}.jsonl")  # fmt: skip
    return row


def claim_next(claims: Path, pending: list[RunSpec]) -> tuple[RunLock | None, RunSpec]:
    """The first pending run that no other worker holds, claimed; (None, the last one) where
    all are held."""
    held, spec = None, pending[0]
    for spec in pending:
        held = claim(claims, training_key(spec))
        if held is not None:
            break
    return held, spec


def append_row(results_path: Path, row: dict[str, Any]) -> None:
    """Append `row` as a line of its own (the caller holds the results lock)."""
    with results_path.open("a+b") as fh:  # appends go to the end, wherever we read
        if fh.seek(0, 2) > 0:
            fh.seek(-1, 2)
            if fh.read(1) != b"\n":
                fh.write(b"\n")  # end a line cut short by a kill: our row stays whole
        fh.write((json_text(row) + "\n").encode())


def training_key(spec: RunSpec) -> str:
    """What `spec` trains, as a lock name: runs that are each other's `twin` share it."""
    if spec.model.get("router_scores") == "random":  # never reused: see `twin`
        return spec.name
    what = {k: getattr(spec, k) for k in ("budget", "seed", "seq_len", "batch_size",
                                          "capacity_warmup")}  # fmt: skip
    for key in ("lr", "lr_warmup"):  # absent while unset: the keys of earlier runs hold
        if getattr(spec, key) is not None:
            what[key] = getattr(spec, key)
    what["model"] = MoDConfig(**spec.model).resolved()  # every field's value, as built
    text = json.dumps(what, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"train-{digest}"


def claim(folder: Path, name: str) -> RunLock | None:
    """This process's hold on `name`, or None where a live process holds it. A lock that
    cannot be checked (a process on another machine) is an error, not a wait."""
    while True:
        try:
            return RunLock(folder, f"{name}.lock").acquire()
        except RunLockedError as exc:
            if not exc.held:
                raise
            return None
        except FileNotFoundError:  # a finishing worker removed the empty folder under us
            continue
        except FileExistsError:  # ... between mkdir's "it exists" and its check that it does
            continue


@contextlib.contextmanager
def waiting_lock(folder: Path, name: str) -> Iterator[None]:
    """Hold the lock `folder/name`, waiting for it while another process does."""
    lock = claim(folder, name)
    while lock is None:
        time.sleep(0.05)
        lock = claim(folder, name)
    try:
        yield
    finally:
        lock.release()


def twin(spec: RunSpec, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A finished run that trained exactly what `spec` would: the same model, budget, seed,
    context, batch and warm-up (the grid's size-S runs at the ablation and longer budgets are
    the ablations' dense and MoD-arm runs again). Evaluations do not change training, except
    where random routing draws its noise at evaluation too, so those are never reused."""
    if spec.model.get("router_scores") == "random":
        return None
    keys = ("budget", "seed", "seq_len", "batch_size", "capacity_warmup", "lr", "lr_warmup")
    for r in results:
        if any(r.get(k) != getattr(spec, k) for k in keys):
            continue
        vocab = r["model"].get("vocab_size")
        if MoDConfig(**{**spec.model, "vocab_size": vocab}) == MoDConfig(**r["model"]):
            return r
    return None
