"""Train a tiny MoD model for a few steps, load it back (ready to evaluate) and sample from it.
The corpus is this package's own source (no download). ``python examples/train_and_load.py``
(about ten seconds on a CPU); each ``# -> ...`` comment is what the line prints (checked by
tests/test_examples.py). `mod train` does the same from the command line."""

import tempfile
from pathlib import Path

import mixture_of_depths
from mixture_of_depths import MoDConfig, generate, load_model, load_tokenizer
from mixture_of_depths.train import TrainConfig, evaluate_checkpoint, train

corpus = Path(mixture_of_depths.__file__).parent  # a few hundred kB of Python, split by file
with tempfile.TemporaryDirectory() as tmp:
    run = Path(tmp) / "run"
    # calibrate, as `mod train` does: each causal threshold fitted to the capacity at the end
    settings = TrainConfig(out=str(run), data=str(corpus), steps=30, batch_size=8, seq_len=64,
                           eval_every=30, eval_batches=2, warmup_steps=5,
                           calibrate=True)  # fmt: skip
    summary = train(MoDConfig.preset("tiny"), settings, progress=False)
    print(summary["steps"], sorted(summary["routing_recall"]))  # -> 30 ['1', '3']
    print(sorted(summary["calibration"]["after"]["take_rate"]))  # -> ['1', '3']
    print((run / "checkpoint" / "model.safetensors").exists())  # -> True

    model, config = load_model(run)  # a run folder stands for its checkpoint
    # in eval mode, ready to evaluate: a plain forward routes causally
    print(model.training)  # -> False
    ev = evaluate_checkpoint(run, n_batches=2)  # `mod eval runs/...` in Python
    print(0 <= ev["routing_recall"]["1"] <= 1)  # -> True

    tok = load_tokenizer(run)
    res = generate(model, [tok.encode("def ")], max_new_tokens=20, seed=0)
    print(len(res.tokens[0]), type(tok.decode(res.tokens[0])).__name__)  # -> 20 str
