"""A pretrained dense model converted to MoD (`mod study experiments/convert`; needs the [hf]
extra): untrained, router-tuned, distilled and fully fine-tuned, beside the dense model trained
as long; README.md has the question, the command and the answer. The code is `study`."""

from __future__ import annotations

from pathlib import Path

from mixture_of_depths.studies.runner import Loop

from . import study


def _run(out: Path, work: Path, quick: bool, data: str | None, progress: bool) -> int:
    results = study.run(out, work, quick, data, progress)
    print(f"{len(results)} models in {out}/results.jsonl; report: {out}/report.md")
    return 0


STUDY = Loop("convert", study.FOLDERS, _run, report=study.report)

__all__ = ["STUDY"]
