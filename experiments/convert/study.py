"""`mod study experiments/convert`: what a user gets by converting a pretrained dense model to MoD.

A dense model trained by us (`small-dense` on the default corpus, the default job's 600 steps)
is exported to the Llama layout with transformers (`mod export --llama`) and converted back to
MoD (`mod convert`: every other block routed, the straight-through gate) at capacities 0.5, 0.25
and 0.125. At each capacity, four models:

- **converted**: the routers untrained (as initialised);
- **routers**: routers and predictors tuned for `tune_steps`, the rest frozen (`mod tune-routers`,
  capacity warm-up from 1.0 over the first third);
- **routers + distill**: the same with distillation from the frozen dense model (weight 1);
- **full**: every parameter fine-tuned for the same steps from the converted weights;

and, as the fair baseline for the fine-tuned ones, the dense model trained the same steps more
at the full fine-tune's learning rate (**dense + ft**).

Each is evaluated on the same validation batches in causal routing (what generation does; top-k
beside it) and timed decoding beside the dense original (`measure.decode_speeds`: one thread,
prompts of half the context, greedy, the median of interleaved rounds), with nothing else of the
study running. Every step is resumable: a finished one is in ``results.jsonl``; the models live
in the work folder until the report is written.

Learning rates: routers 3e-3 (new parameters), full fine-tune 3e-4 (pretrained weights, a tenth
of the dense run's peak); both with the warm-up and cosine of `TrainConfig`.

The report judges each MoD model against its baseline by the verdict module (`verdicts`: the
conversion against the dense original, a tuned model against dense + ft; one seed each) into
findings.json; `report` rewrites it from results.jsonl alone (`mod study experiments/convert
--report`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixture_of_depths.config import MoDConfig
from mixture_of_depths.convert import convert_folder
from mixture_of_depths.fileio import atomic_write_text, json_text
from mixture_of_depths.runtime.checkpoint import load_config, resolve_checkpoint
from mixture_of_depths.studies.plots import pyplot
from mixture_of_depths.studies.runner import Folders, load_results
from mixture_of_depths.studies.verdict import Arm, Verdict, compare
from mixture_of_depths.train import TrainConfig, evaluate_checkpoint, has_checkpoint, train

from ..common.measure import decode_speeds

CAPACITIES = (0.5, 0.25, 0.125)
VARIANTS = ("converted", "routers", "routers+distill", "full")
FOLDERS = Folders(str(Path(__file__).resolve().parent))


@dataclasses.dataclass(frozen=True)
class Settings:
    preset: str = "small-dense"
    dense_steps: int = 600
    tune_steps: int = 300
    batch_size: int = 16
    eval_batches: int = 8
    router_lr: float = 3e-3
    full_lr: float = 3e-4


QUICK = Settings("tiny-dense", 12, 6, 4, 1)


def _tag(c: float) -> str:
    return f"c{round(c * 1000):04d}"


@dataclasses.dataclass
class _Job:
    """One run of the study: its settings, folders and the rows done so far (by name)."""

    s: Settings
    work: Path
    data: str | None
    progress: bool
    path: Path  # results.jsonl, rewritten whole on every record
    done: dict[str, dict[str, Any]]

    def record(self, name: str, **fields: Any) -> None:
        self.done[name] = {"name": name, **fields}
        text = "".join(json_text(r, indent=None) + "\n" for r in self.done.values())
        atomic_write_text(self.path, text)

    def evaluate(self, ckpt: Path) -> dict[str, Any]:
        ev = evaluate_checkpoint(ckpt, self.data, self.s.eval_batches, self.s.batch_size)
        keep = ("val_loss_topk", "val_loss_causal", "routing_accuracy", "causal_take_rate")
        return {k: ev[k] for k in keep if k in ev}

    def train_run(self, run_dir: Path, cfg: MoDConfig | None, **kw: Any) -> None:
        """Train into `run_dir` (from `cfg`, or resumed from its checkpoint if it has one)."""
        resume = has_checkpoint(run_dir)
        tc = TrainConfig(
            out=str(run_dir), data=self.data, batch_size=self.s.batch_size,
            eval_batches=self.s.eval_batches, **kw,
        )  # fmt: skip
        train(None if resume else cfg, tc, resume=resume, overwrite=not resume,
              progress=self.progress)  # fmt: skip


def run(
    out: str | Path | None = None,
    work: str | Path | None = None,
    quick: bool = False,
    data: str | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run (or resume) the conversion study; returns its rows and writes the report and plot.
    `out` / `work` default to `FOLDERS` (``-quick`` beside them for a quick run)."""
    s = QUICK if quick else Settings()
    out = Path(out or FOLDERS.out_for(quick))
    work = Path(work or FOLDERS.work_for(quick))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    job = _Job(s, work, data, progress, path, {r["name"]: r for r in load_results(path)})
    _dense(job)
    llama = work / "dense-llama"
    if not llama.exists():
        from mixture_of_depths.hf import export_llama  # the [hf] extra

        export_llama(work / "dense" / "checkpoint", llama)
    for c in CAPACITIES:
        _converted(job, llama, c)
    if not all("decode_tok_s_b1" in r for n, r in job.done.items() if n != "dense+ft"):
        measure_decode(job.done, work, data, job.record)
    results = list(job.done.values())
    write_report(results, out, s)
    return results


def _dense(job: _Job) -> None:
    """The dense model, and the fair baseline: the dense model trained the same steps more."""
    s, dense_dir = job.s, job.work / "dense"
    if "dense" not in job.done:
        steps = s.dense_steps
        job.train_run(dense_dir, MoDConfig.preset(s.preset), steps=steps, eval_every=steps)
        job.record("dense", variant="dense", capacity=1.0, **job.evaluate(dense_dir / "checkpoint"))
    if "dense+ft" not in job.done:
        run_dir = job.work / "dense+ft"
        job.train_run(
            run_dir, None, init_from=str(dense_dir / "checkpoint"), steps=s.tune_steps,
            eval_every=s.tune_steps, warmup_steps=max(1, s.tune_steps // 10), lr=s.full_lr,
        )  # fmt: skip
        ev = job.evaluate(run_dir / "checkpoint")
        job.record("dense+ft", variant="dense+ft", capacity=1.0, **ev)


def _converted(job: _Job, llama: Path, c: float) -> None:
    """At capacity `c`: the conversion, then its router-tuned, distilled and fine-tuned runs."""
    s = job.s
    conv = job.work / f"converted-{_tag(c)}"
    if not conv.exists():
        convert_folder(llama, conv, "DR", c)
    if f"converted-{_tag(c)}" not in job.done:
        job.record(f"converted-{_tag(c)}", variant="converted", capacity=c, **job.evaluate(conv))
    tunes = {
        "routers": dict(tune="routers", lr=s.router_lr),
        "routers+distill": dict(tune="routers", lr=s.router_lr, distill=1.0),
        "full": dict(tune="all", lr=s.full_lr),
    }
    for variant, kw in tunes.items():
        name = f"{variant}-{_tag(c)}"
        if name in job.done:
            continue
        run_dir = job.work / name
        job.train_run(
            run_dir, None, init_from=str(resolve_checkpoint(conv)), steps=s.tune_steps,
            eval_every=s.tune_steps, capacity_warmup=s.tune_steps // 3,
            warmup_steps=max(1, s.tune_steps // 10), **kw,
        )  # fmt: skip
        job.record(name, variant=variant, capacity=c, **job.evaluate(run_dir / "checkpoint"))


def _ckpt(work: Path, name: str) -> Path:
    return work / name if name.startswith("converted") else work / name / "checkpoint"


def measure_decode(
    done: dict[str, dict[str, Any]],
    work: Path,
    data: str | None,
    record: Callable[..., None],
) -> None:
    """Decode tokens/s of every model beside the dense original, one capacity at a time (the
    dense model timed in each group, so every ratio is of models timed side by side)."""
    seq_len = load_config(work / "dense" / "checkpoint").max_seq_len
    dense = {k: v for k, v in done["dense"].items() if k != "name"}
    for c in CAPACITIES:
        names = [f"{v}-{_tag(c)}" for v in VARIANTS]
        ckpts = {"dense": work / "dense" / "checkpoint", **{n: _ckpt(work, n) for n in names}}
        speeds = decode_speeds(ckpts, seq_len, data)
        ref = speeds["dense"]
        for n in names:
            fields = {k: v for k, v in done[n].items() if k != "name"}
            fields.update(speeds[n])
            for b in (1, 8):
                fields[f"speedup_b{b}"] = (
                    speeds[n][f"decode_tok_s_b{b}"] / ref[f"decode_tok_s_b{b}"]
                )
            record(n, **fields)
        dense.setdefault("decode_by_group", {})[_tag(c)] = ref
        for k, v in ref.items():
            dense.setdefault(k, v)
    record("dense", **dense)


def _arm(r: dict[str, Any], label: str, lr: float | None, size: str) -> Arm:
    """One model as an `Arm`: its seed's loss (every model here trained one seed: TrainConfig's
    0), one size (the preset) and, where it trained, one learning rate tried."""
    rate = None if lr is None else f"one learning rate tried ({lr:g})"
    return Arm(label, {r.get("seed", 0): r["val_loss_causal"]}, f"one size tried ({size})", rate)


def verdicts(results: list[dict[str, Any]], s: Settings) -> dict[str, Verdict]:
    """Each MoD model against its baseline (`verdict.compare`), by key: the untrained conversion
    against the dense original; a tuned one against the dense model trained as many steps more
    (dense + ft), the fair baseline for anything that trained again."""
    by = {r["name"]: r for r in results}
    out: dict[str, Verdict] = {}
    for c in CAPACITIES:
        for v in VARIANTS:
            r = by.get(f"{v}-{_tag(c)}")
            base = by.get("dense" if v == "converted" else "dense+ft")
            if r is None or base is None:
                continue
            lr = None if v == "converted" else s.full_lr if v == "full" else s.router_lr
            a = _arm(r, f"{v} at capacity {c}", lr, s.preset)
            if v == "converted":
                b, against = _arm(base, "dense original", None, s.preset), "dense"
            else:
                b = _arm(base, f"dense + {s.tune_steps} steps", s.full_lr, s.preset)
                against = "dense-ft"
            out[f"{v.replace('+', '-')}-{_tag(c)}-vs-{against}"] = compare(a, b)
    return out


def _one_seed(judged: dict[str, Verdict]) -> list[bool]:
    return [len(v.a.seeds) == len(v.b.seeds) == 1 for v in judged.values()]


def write_report(results: list[dict[str, Any]], out: Path, s: Settings) -> None:
    """report.md, findings.json (the verdicts, by key) and convert.png from `results`."""
    by = {r["name"]: r for r in results}
    dense = by.get("dense", {})
    base = dense.get("val_loss_causal")
    judged = verdicts(results, s)
    lines = [
        "# Converting a pretrained dense model to MoD",
        "",
        f"`mod study experiments/convert`: `{s.preset}` trained {s.dense_steps} steps on the "
        f"default corpus, exported to the Llama layout, converted back to MoD (every other block "
        f"routed) and tuned {s.tune_steps} steps (routers lr {s.router_lr}, full fine-tune lr "
        f"{s.full_lr}, batch {s.batch_size}). Validation: {s.eval_batches} batches, causal "
        "routing (generation's) and top-k. Decode: tokens/s at batch 1 and 8 beside the dense "
        "original, one thread, the median of interleaved rounds. `mod study experiments/convert "
        "--report` rewrites this page from results.jsonl.",
        "",
        "| capacity | model | val loss causal | vs dense | val loss top-k | decode b1 tok/s | "
        "speed-up b1 | speed-up b8 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if dense:
        lines.append(
            f"| 1.0 | dense original | {dense['val_loss_causal']:.4f} | | "
            f"{dense['val_loss_topk']:.4f} | {dense.get('decode_tok_s_b1', float('nan')):,.0f} "
            "| 1.00x | 1.00x |"
        )
    ft = by.get("dense+ft")
    if ft and base is not None:
        lines.append(
            f"| 1.0 | dense + {s.tune_steps} steps | {ft['val_loss_causal']:.4f} | "
            f"{ft['val_loss_causal'] - base:+.4f} | {ft['val_loss_topk']:.4f} | | | |"
        )
    for c in CAPACITIES:
        for v in VARIANTS:
            r = by.get(f"{v}-{_tag(c)}")
            if r is None:
                continue
            gap = f"{r['val_loss_causal'] - base:+.4f}" if base is not None else ""
            nan = float("nan")
            speed = (r.get("decode_tok_s_b1", nan), r.get("speedup_b1", nan))
            lines.append(
                f"| {c} | {v} | {r['val_loss_causal']:.4f} | {gap} | {r['val_loss_topk']:.4f} | "
                f"{speed[0]:,.0f} | {speed[1]:.2f}x | {r.get('speedup_b8', nan):.2f}x |"
            )
    if judged:
        lines += [
            "",
            "## Against the baselines",
            "",
            "Each verdict is the verdict module's (`mixture_of_depths.studies.verdict`): the "
            "untrained conversion against the dense original, each tuned model against the dense "
            f"model trained {s.tune_steps} steps more (the same steps)."
            + (" Every model trained one seed." if all(_one_seed(judged)) else ""),
            "",
            *[f"- {v.text()}" for v in judged.values()],
        ]
    atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
    found = {"verdicts": {k: v.as_dict() for k, v in judged.items()}}
    atomic_write_text(out / "findings.json", json_text(found, indent=1) + "\n")
    _plot(results, out)


def report(out: Path, quick: bool) -> None:
    """`mod study experiments/convert --report`: the report from ``out/results.jsonl`` alone."""
    results = load_results(out / "results.jsonl")
    if not results:
        raise ValueError(f"no results in {out / 'results.jsonl'}: nothing to report")
    write_report(results, out, QUICK if quick else Settings())


def _plot(results: list[dict[str, Any]], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"converted": "x", "routers": "o", "routers+distill": "s", "full": "^"}
    colors = dict(zip(CAPACITIES, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    for r in results:
        if "speedup_b1" not in r:
            continue
        ax.scatter(r["speedup_b1"], r["val_loss_causal"], marker=markers[r["variant"]],
                   color=colors[r["capacity"]], s=50)  # fmt: skip
    dense = next((r for r in results if r["name"] == "dense"), None)
    if dense:
        ax.scatter(1.0, dense["val_loss_causal"], marker="*", color="black", s=150)
    ft = next((r for r in results if r["name"] == "dense+ft"), None)
    if ft:
        ax.scatter(1.0, ft["val_loss_causal"], marker="P", color="black", s=80)
        ax.scatter([], [], marker="P", color="black", label="dense + same steps")
    for v, m in markers.items():
        ax.scatter([], [], marker=m, color="gray", label=v)
    for c, col in colors.items():
        ax.scatter([], [], marker="o", color=col, label=f"capacity {c}")
    ax.scatter([], [], marker="*", color="black", label="dense original")
    ax.set_xlabel("decode speed-up vs dense (batch 1)")
    ax.set_ylabel("validation loss, causal routing (nats/token)")
    ax.set_title("Pretrained dense -> MoD: speed against loss")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    tmp = out / ".convert.png.tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out / "convert.png")
