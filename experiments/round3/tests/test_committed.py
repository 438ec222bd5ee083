"""The committed report is what the committed results say: rewritten from results.jsonl and the
metrics into a fresh folder (as `mod study experiments/round3 --report` does, training nothing),
report.md and findings.json come out byte for byte; and the verdicts issue 52 named say what the
verdict module says of them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from experiments.round3 import STUDY
from mixture_of_depths.studies import verdict as vd
from mixture_of_depths.studies.runner import rewrite_report

ROUND3 = Path(__file__).resolve().parents[1]


def test_the_committed_report_is_rewritten_byte_for_byte_from_the_committed_results(tmp_path):
    out = tmp_path / "round3"
    out.mkdir()
    shutil.copy(ROUND3 / "results.jsonl", out)
    shutil.copytree(ROUND3 / "metrics", out / "metrics")  # the gates and copy scores per eval
    if (ROUND3 / "notes.md").exists():
        shutil.copy(ROUND3 / "notes.md", out)
    rewrite_report(STUDY, out)
    for name in ("report.md", "findings.json"):
        assert (out / name).read_bytes() == (ROUND3 / name).read_bytes(), (
            f"experiments/round3/{name} is stale: run `mod study experiments/round3 --report`"
        )


def _verdict(key: str) -> dict:
    return json.loads((ROUND3 / "findings.json").read_text())["verdicts"][key]


def test_no_committed_verdict_names_a_winner_its_grids_do_not_allow():
    # dense XS's best rate, 4e-3, is the top of its rates, at one size: never "better" than 2e-3
    tuned = _verdict("dense-lr4e-3-vs-dense")
    assert tuned["verdict"] == vd.UNBRACKETED and "is the highest tried" in tuned["why"]
    # MLP-only against dense at their best rates: within the spread, with dense's open ends named
    best = _verdict("mlp-vs-dense-best-rates")
    assert best["verdict"] == vd.WITHIN and round(best["diff"], 4) == 0.0816
    assert any("4e-3, is the highest tried" in c for c in best["caveats"])
    assert "dense XS, lr 4e-3: one size tried (XS)" in best["caveats"]
    assert _verdict("mlp-vs-dense")["verdict"] == vd.WITHIN  # at 2e-3: -4.1%, not "better"
    # at 5e13 each side's best size sits at an end of its sizes
    iso = _verdict("iso-5e13-mlp-vs-dense-best")
    assert iso["verdict"] == vd.UNBRACKETED
    assert any("XS, is the largest tried (XXS, XS)" in c for c in iso["caveats"])
    assert any("XXS, is the smallest tried (XXS, XS, S)" in c for c in iso["caveats"])
    # MLP-only's sizes at 1.5e14 share one seed: a reading; MoD's 4e-3 against its 2e-3: within
    assert _verdict("iso-1.5e14-mlp-xs-vs-s")["verdict"] == vd.ONE_SEED
    assert _verdict("mod-lr4e-3-vs-mod")["verdict"] == vd.WITHIN
