"""Where a `mod serve` engine step's time goes: benchmarks/serve.py --profile (docs/serving.md).

    python serve_profile.py OUT.json CKPT [mod serve's flags]

runs `mod serve` itself (`mixture_of_depths.cli.main`) with its engine's step wrapped. SIGUSR1
starts recording, a second SIGUSR1 stops it (the benchmark sends them around a saturated load,
so start-up and warm-up are left out); when the server exits (SIGTERM) the record goes to
OUT.json. Steps alternate between two views, so that neither distorts the other:

- even steps, **phases**: wall time of named parts of the step (scheduler, the model's forward,
  page reads, gathers and writes, routing counts, sampling), each exclusive of the parts it
  calls, so they add up to the step; and the engine thread's CPU time beside the step's wall
  time (the difference: waiting for the GIL, which the HTTP threads hold while they serialise
  tokens, or for a CPU other processes hold);
- odd steps, **functions**: cProfile on the engine thread, self time per function, grouped by
  kind (torch ops, host reads, the engine's Python, the model's Python). cProfile slows Python
  code more than torch ops, so Python's share there is an upper bound; the phases are not slowed.

A part the engine no longer has (after a refactor) is listed as missing, not guessed; its time
falls to the part that calls it. The labels stay fixed so that profiles taken before and after
engine work compare line by line.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DECODE = "forward: decode entries (model)"
PREFILL = "forward: new rows' prefill (model)"
STEP = "step: the rest (locks, cancels, admission's bookkeeping)"
# (module, attribute path, label, what to count per call from the arguments)
PHASES: tuple[tuple[str, str, str, Callable[..., int] | None], ...] = (
    ("scheduler", "Scheduler.admit", "scheduler: admission", None),
    ("scheduler", "Scheduler.plan", "scheduler: plan", None),
    ("paged", "PagedKVCache.snapshot", "cache: snapshot (to undo a failed forward)", None),
    ("engine", "prefill", PREFILL, lambda *a, **k: int(a[2].sum())),
    ("engine", "decode_step", DECODE, lambda *a, **k: len(a[1])),
    ("paged", "PagedPrefill.write_prefill", "pages: prefill writes", None),
    ("paged", "PagedView.append", "pages: decode appends", None),
    ("paged", "PagedView.read", "pages: reads (masks, per-entry bookkeeping)", None),
    ("paged", "PagedKVCache._gather", "pages: gathers (page tables -> padded K/V)", None),
    ("paged", "PagedView.subset", "pages: views of a routed layer's rows", None),
    ("engine", "Engine._count_routing", "routing counts", None),
    ("engine", "Engine._sample", "sampling and events", None),
    # since 703be97 a row's text and event come after the batched sampling, and readers are
    # woken once per step: the same phase, so profiles before and after compare line by line
    ("engine", "Engine._emit", "sampling and events", None),
    ("engine", "wake_all", "sampling and events", None),
)
HOST_READS = ("'item'", "'tolist'", "'cpu'", "'numpy'", "'nonzero'", "_local_scalar_dense")


class StepProfiler:
    """The record of one server's steps (see the module docstring)."""

    def __init__(self) -> None:
        self.recording = False
        self.calls = 0
        self.engine_tid: int | None = None
        self.engine_ident: int | None = None
        self.stack: list[float] = []
        self.active = False
        self.phases: dict[str, list[float]] = {}  # label -> [incl s, excl s, calls, counted]
        self.clean_steps = self.profiled_steps = 0
        self.step_cpu = 0.0
        self.cprof = cProfile.Profile()
        self.missing: list[str] = []
        self.window: dict[str, float] = {}
        self.first = self.last = self.in_steps = 0.0

    # -- wrappers ---------------------------------------------------------------------------------
    def timed(self, label: str, fn: Callable, count: Callable[..., int] | None = None) -> Callable:
        prof = self

        def wrapper(*a: Any, **k: Any) -> Any:
            if not prof.active or threading.get_ident() != prof.engine_ident:
                return fn(*a, **k)
            prof.stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                child = prof.stack.pop()
                s = prof.phases.setdefault(label, [0.0, 0.0, 0, 0])
                s[0] += dt
                s[1] += dt - child
                s[2] += 1
                s[3] += _count(count, a, k)
                if prof.stack:
                    prof.stack[-1] += dt

        return wrapper

    def install(self) -> None:
        """Wrap the engine's step and each phase that exists (the others are listed missing)."""
        import importlib

        engine = importlib.import_module("mixture_of_depths.serve.engine")
        for mod_name, path, label, count in PHASES:
            owner: Any = importlib.import_module(f"mixture_of_depths.serve.{mod_name}")
            *parents, attr = path.split(".")
            for p in parents:
                owner = getattr(owner, p, None)
            fn = getattr(owner, attr, None) if owner is not None else None
            if fn is None:
                self.missing.append(f"{mod_name}.{path}")
                continue
            setattr(owner, attr, self.timed(label, fn, count))
        step = engine.Engine.step
        timed_step = self.timed(STEP, step)
        prof = self

        def wrapped(engine_self: Any) -> bool:
            if prof.engine_ident is None:
                prof.engine_ident, prof.engine_tid = (
                    threading.get_ident(),
                    threading.get_native_id(),
                )
            if not prof.recording:
                return step(engine_self)
            prof.calls += 1
            t0 = time.perf_counter()
            if prof.calls % 2:
                ran = prof.profiled_step(step, engine_self)
            else:
                ran = prof.clean_step(timed_step, engine_self)
            if ran:  # the window the engine was stepping in, and its time in steps
                t1 = time.perf_counter()
                prof.first = prof.first or t0
                prof.last, prof.in_steps = t1, prof.in_steps + t1 - t0
            return ran

        engine.Engine.step = wrapped

    def profiled_step(self, step: Callable, engine_self: Any) -> bool:
        self.cprof.enable()
        try:
            ran = step(engine_self)
        finally:
            self.cprof.disable()
        self.profiled_steps += bool(ran)
        return ran

    def clean_step(self, timed_step: Callable, engine_self: Any) -> bool:
        before = {k: list(v) for k, v in self.phases.items()}
        c0 = time.thread_time()
        self.active = True
        try:
            ran = timed_step(engine_self)
        finally:
            self.active = False
        if not ran:  # nothing to run: an idle wake-up is not a step
            self.phases = before
            return ran
        self.step_cpu += time.thread_time() - c0
        self.clean_steps += 1
        return ran

    # -- the recording window ---------------------------------------------------------------------
    def toggle(self, *_: Any) -> None:
        """SIGUSR1: start recording, or stop it; with the engine thread's and the process's CPU
        time over the window (the rest of the process: the HTTP side)."""
        now = {
            "wall": time.perf_counter(),
            "process_cpu": _process_cpu(),
            "engine_cpu": _thread_cpu(self.engine_tid),
        }
        if not self.recording:
            self.window = {f"{k}_0": v for k, v in now.items() if v is not None}
            self.recording = True
            return
        self.recording = False
        for k, v in now.items():
            if v is not None and f"{k}_0" in self.window:
                self.window[k] = v - self.window.pop(f"{k}_0")

    def result(self) -> dict[str, Any]:
        n = max(self.clean_steps, 1)
        wall = self.phases.get(STEP, [0.0])[0]  # the step's own timer: the phases add up to it
        phases = [
            {
                "label": label,
                "ms_per_step": 1e3 * s[1] / n,
                "share": s[1] / wall,
                "incl_ms_per_step": 1e3 * s[0] / n,
                "calls_per_step": s[2] / n,
                "count_per_step": s[3] / n,
            }
            for label, s in self.phases.items()
            if wall > 0
        ]
        phases.sort(key=lambda p: -p["ms_per_step"])
        return {
            "clean_steps": self.clean_steps,
            "profiled_steps": self.profiled_steps,
            "step_ms": 1e3 * wall / n,
            "step_cpu_ms": 1e3 * self.step_cpu / n,
            "window": self.window,
            "steps_span_s": self.last - self.first,
            "stepping_share": self.in_steps / (self.last - self.first) if self.last else None,
            "phases": phases,
            "missing": self.missing,
            **functions(self.cprof, max(self.profiled_steps, 1)),
        }


def _count(count: Callable[..., int] | None, a: tuple, k: dict) -> int:
    """What a phase counts per call (entries, prompt tokens), 0 if its arguments changed."""
    try:
        return int(count(*a, **k)) if count else 0
    except (IndexError, TypeError):
        return 0


def _process_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _thread_cpu(tid: int | None) -> float | None:
    """CPU seconds of thread `tid` of this process (Linux), None where unknown."""
    if tid is None:
        return None
    try:
        fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# -- cProfile's functions, named and grouped -----------------------------------------------------
def name_and_kind(filename: str, func: str) -> tuple[str, str]:
    """A stable name (no line numbers) and a kind for one of cProfile's entries."""
    if filename == "~":
        name = func.strip("<>").replace("built-in method ", "").replace(" objects", "")
        if any(h in func for h in HOST_READS):
            return name, "host reads (a sync on a GPU)"
        if "torch" in func:
            return name, "torch ops"
        if "acquire" in func or "wait" in func:
            return name, "locks and waits"
        return name, "Python builtins"
    path = filename.replace(os.sep, "/")
    for marker, kind in (
        ("mixture_of_depths/serve/", "engine Python (serve/)"),
        ("mixture_of_depths/", "model Python (library)"),
        ("site-packages/torch/", "torch Python"),
    ):
        if marker in path:
            rel = path.split(marker, 1)[1]
            prefix = {"engine Python (serve/)": "serve/", "torch Python": "torch/"}.get(kind, "")
            return f"{prefix}{rel}:{func}", kind
    return f"{Path(path).name}:{func}", "other Python"


def functions(prof: cProfile.Profile, steps: int, top: int = 30) -> dict[str, Any]:
    """Self time per function and per kind, in ms per profiled step, largest first."""
    try:
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    except TypeError:  # nothing was recorded
        return {"functions": [], "kinds": []}
    by_name: dict[str, list[Any]] = {}
    for (filename, _, func), (_, calls, self_s, _, _) in stats.items():
        name, kind = name_and_kind(filename, func)
        entry = by_name.setdefault(name, [kind, 0.0, 0])
        entry[1] += self_s
        entry[2] += calls
    total = sum(e[1] for e in by_name.values()) or 1.0
    kinds: dict[str, float] = {}
    for kind, self_s, _ in by_name.values():
        kinds[kind] = kinds.get(kind, 0.0) + self_s
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "functions": [
            {
                "name": n,
                "kind": k,
                "self_ms_per_step": 1e3 * s / steps,
                "share": s / total,
                "calls_per_step": c / steps,
            }
            for n, (k, s, c) in rows
        ],
        "kinds": [
            {"kind": k, "self_ms_per_step": 1e3 * s / steps, "share": s / total}
            for k, s in sorted(kinds.items(), key=lambda kv: -kv[1])
        ],
        "profiled_ms_per_step": 1e3 * total / steps,
    }


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    prof = StepProfiler()
    prof.install()
    signal.signal(signal.SIGUSR1, prof.toggle)
    from mixture_of_depths.cli import main as mod_main

    code = mod_main(["serve", *argv[1:]])
    out.write_text(json.dumps(prof.result()))
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
