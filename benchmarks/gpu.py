"""The ``mod bench`` comparison on a CUDA GPU: bf16 autocast, SDPA's fused kernels, eager and
compiled, at lengths and a model size where a GPU has work to do (preset base by default).

    python benchmarks/gpu.py                       # everything, preset base
    python benchmarks/gpu.py --sections train,compile --seq-lens 2048

Extra flags go to ``mod bench``. Without a CUDA device it says so, measures nothing, and exits 0
with ``{"gpu": false}`` as its last line. The last line is JSON.
"""

from __future__ import annotations

import json
import sys

import torch

from mixture_of_depths.bench.suite import main

DEFAULTS = ["--device", "cuda", "--dtype", "bfloat16", "--preset", "base", "--tokens", "16384"]
DEFAULTS += ["--seq-lens", "512,2048,4096", "--repeats", "10", "--warmup", "3"]

if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA GPU here (torch.cuda.is_available() is False): nothing was measured")
        print(json.dumps({"gpu": False, "torch": torch.__version__}))
        sys.exit(0)
    print(f"GPU: {torch.cuda.get_device_name()}")
    main([*DEFAULTS, *sys.argv[1:]])  # later flags override the defaults
