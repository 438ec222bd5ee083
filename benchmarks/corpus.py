"""The default corpus's size, and what one epoch of it allows the GPU plan (experiments/gpu): the
files and bytes of this Python's standard library, its BPE training and held-out tokens (the
study's vocabulary, 4096), the one-epoch budget cap and each deciding arm's steps and tokens at
it. Counts and arithmetic, no timing; the last line printed is JSON (docs/bench.md quotes it from
docs/bench/corpus-bpe.json).

    python benchmarks/corpus.py > docs/bench/corpus-bpe.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/, from a checkout

from experiments.gpu import planning  # noqa: E402
from mixture_of_depths.data import stream  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=None, help="corpus folder (default: Python's stdlib)")
    args = ap.parse_args(argv)
    files = stream.corpus_files(args.data)
    train, val, tok = stream.load_splits(args.data, "bpe")
    s = planning.FULL
    cap = planning.round_down(
        planning.corpus_budget(s, planning.specs(s, 1.0, tok.vocab_size), len(train))
    )
    arms = {}
    for tag in ("dense", "mod", "residual"):
        spec = planning.spec_of(s, tag, 0, cap, tok.vocab_size)
        n = planning.tokens_of(s, spec)
        arms[tag] = {"label": spec.label, "steps": planning.steps_of(s, spec), "tokens": n,
                     "share_of_split": n / len(train)}  # fmt: skip
    out = {
        "python": platform.python_version(),
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "vocab_size": tok.vocab_size,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "gpu_plan": {"corpus_budget": cap, "arms": arms},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
