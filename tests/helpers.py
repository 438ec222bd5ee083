"""Model factories and routing fixtures shared by the test modules (no oracles here: those live in
reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from reference import randomise

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.routing import calibrate_predictors
from mixture_of_depths.train import TrainConfig

# The `mod` command run in a subprocess that kill -9s itself at a chosen point (crash.py).
CRASH = Path(__file__).with_name("crash.py")

V = 61  # vocabulary of the test models


def tiny_config(**overrides) -> MoDConfig:
    """The test models' shape: GQA, four layers "RDR" tiled (R D R R), an awkward capacity."""
    base = dict(
        vocab_size=V, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128,
        layer_pattern="RDR", capacity=0.3, predictor_hidden=16,
    )  # fmt: skip
    return MoDConfig(**{**base, **overrides})


def random_tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def make_model(
    config: MoDConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    take: float = 0.5,
    calib_idx: torch.Tensor | None = None,
) -> MoDTransformer:
    """`config` with O(1) random weights (`randomise`) in `dtype`, in eval mode. Predictors are
    calibrated so that about a share `take` of the tokens of `calib_idx` takes each routed block
    (an untrained predictor says "take" or "skip" for nearly every token)."""
    torch.manual_seed(seed)
    model = MoDTransformer(config)
    randomise(model, seed + 1)
    model = model.to(dtype).eval()
    if config.has_predictor and not config.is_dense:
        idx = random_tokens(4, 32, seed=99) if calib_idx is None else calib_idx
        calibrate_predictors(model, idx, take)
    return model


@torch.no_grad()
def force_routing(
    model: MoDTransformer, take: bool | list[bool], layers: list[int] | None = None
) -> None:
    """Make every token take (or skip) the routed blocks `layers` (all routed ones by default);
    `take` one decision for all, or one per router in layer order."""
    takes = iter(take) if isinstance(take, list) else None
    for block in model.blocks:
        if not block.routed or (layers is not None and block.layer not in layers):
            continue
        for kind in block.route_kinds:
            if takes is not None:
                take = bool(next(takes))
            if model.config.has_predictor:
                block.predictor[kind].fc2.weight.zero_()
                block.predictor[kind].fc2.bias.fill_(5.0 if take else -5.0)
            else:
                assert not take, "an aux_loss router has no bias: r = x @ w cannot be forced > 0"
                block.router[kind].weight.zero_()  # r = 0: sigmoid(r) = 0.5 is not > 0.5


def dense_twin_with_same_weights(model: MoDTransformer) -> MoDTransformer:
    """The dense twin of `model` with the same shared weights (routers and predictors dropped)."""
    dense = MoDTransformer(model.config.dense_twin()).to(next(model.parameters()).dtype)
    result = dense.load_state_dict(model.state_dict(), strict=False)
    assert result.missing_keys == []
    assert all(".router." in k or ".predictor." in k for k in result.unexpected_keys)
    return dense.eval()


def unit_gates(monkeypatch) -> None:  # noqa: ANN001
    """g(r) = 1 for every routed block: a block every token takes then computes a dense block."""
    monkeypatch.setattr(
        "mixture_of_depths.routed.gate", lambda cfg, r, like: torch.ones_like(r, dtype=like.dtype)
    )


# -- training runs ---------------------------------------------------------------------------------
TINY = dict(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, predictor_hidden=8)


def write_corpus(d: Path) -> Path:
    """Twelve small files of Python-like words: enough for tiny runs' train and val splits."""
    d.mkdir(parents=True, exist_ok=True)
    rng = torch.Generator().manual_seed(0)
    words = "def return self import class for in if else x y ( )".split()
    for i in range(12):
        idx = torch.randint(0, len(words), (400,), generator=rng).tolist()
        (d / f"f{i:02d}.py").write_text(" ".join(words[j] for j in idx) + "\n")
    return d


def tc(corpus: Path, out: Path, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        data=str(corpus),
        batch_size=4,
        steps=6,
        eval_every=3,
        eval_batches=2,
        log_every=1,
        warmup_steps=2,
        lr=3e-3,
    )
    return TrainConfig(**{**base, **kw})


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def train_until(
    cfg: MoDConfig, t: TrainConfig, stop_at: int, saver: str = "save_checkpoint"
) -> None:
    """Run `t` but die right after the checkpoint at `stop_at` (as a crash would); `saver`: the
    checkpoint writer the training loop calls (`save_sharded_checkpoint` for sharded runs)."""
    import pytest

    import mixture_of_depths.train.loop as tr

    real = getattr(tr, saver)

    class Stop(Exception):
        pass

    def save_then_stop(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        real(*a, **kw)
        if kw["trainer_state"]["step"] >= stop_at:
            raise Stop

    setattr(tr, saver, save_then_stop)
    try:
        with pytest.raises(Stop):
            tr.train(cfg, t, progress=False)
    finally:
        setattr(tr, saver, real)
