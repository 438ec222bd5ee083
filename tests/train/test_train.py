"""Trainer, checkpoints and the `mod` command, on a tiny model and a tiny temporary corpus."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import TINY, losses, tc, train_until

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cli import main
from mixture_of_depths.data import ByteTokenizer
from mixture_of_depths.flops import estimate_flops
from mixture_of_depths.runtime.checkpoint import load_model, save_checkpoint
from mixture_of_depths.train import TrainConfig, lr_at, train


@pytest.mark.parametrize("causal_router", ["aux_loss", "predictor"])
def test_resume_reproduces_uninterrupted_run(corpus: Path, tmp_path: Path, causal_router: str):
    cfg = MoDConfig(**TINY, causal_router=causal_router)
    full = tmp_path / "full"
    train(cfg, tc(corpus, full), progress=False)
    first = tmp_path / "first"
    stopped = tc(corpus, first, steps=6, eval_every=3)
    train_until(cfg, stopped, stop_at=3)  # dies right after the step-3 checkpoint
    train(None, stopped, resume=True, progress=False)
    want, got = losses(full), losses(first)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:
        assert got[step] == want[step], (step, got[step], want[step])  # bit-exact on CPU
    m_full, _ = load_model(full / "checkpoint")
    m_res, _ = load_model(first / "checkpoint")
    for (n, a), (_, b) in zip(m_full.state_dict().items(), m_res.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    # the routing diagnostics too, with the step-6 flips counted against the step-3 decisions
    # the resumed run read back from its checkpoint
    diag = {
        name: {r["step"]: r["routing_diag"] for r in map(json.loads, (d / "metrics.jsonl").open())
               if "routing_diag" in r}
        for name, d in (("full", full), ("resumed", first))
    }  # fmt: skip
    assert sorted(diag["full"]) == [3, 6] and diag["full"] == diag["resumed"]
    assert all(v["topk_flips"] == v["topk_flips"] for v in diag["resumed"][6].values())  # not NaN


@pytest.mark.parametrize("scores", ["learned", "random"])
def test_checkpoints_between_evaluations_resume_exactly_inside_capacity_warmup(
    corpus, tmp_path, monkeypatch, scores
):
    """`checkpoint_every` writes checkpoints with no evaluation; a run killed two steps after one
    (at step 3, inside the capacity warm-up) resumes from it to the uninterrupted run's losses,
    weights and evaluations, bit-exact, its log cut back to the checkpoint's step. Random
    routing draws its scores from the global generator, so the checkpoint must carry its state."""
    import mixture_of_depths.train.loop as tr

    cfg = MoDConfig(**TINY, causal_router="predictor", router_scores=scores)
    kw = dict(steps=8, eval_every=8, capacity_warmup=5)
    full = tmp_path / "full"
    train(cfg, tc(corpus, full, **kw), progress=False)
    cut = tmp_path / "cut"
    t = tc(corpus, cut, checkpoint_every=3, **kw)
    real_log = tr._log_step

    def log_then_die(run, done, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        real_log(run, done, *a, **k)
        if done == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(tr, "_log_step", log_then_die)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, t, progress=False)
    monkeypatch.setattr(tr, "_log_step", real_log)
    rows = [json.loads(ln) for ln in (cut / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # no evaluation came with step 3's save
    train(None, t, resume=True, progress=False)
    steps = [json.loads(ln)["step"] for ln in (cut / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 8]  # 4 and 5 again from the step-3 checkpoint
    want, got = losses(full), losses(cut)
    assert got == want  # bit-exact on CPU
    m_full, _ = load_model(full / "checkpoint")
    m_cut, _ = load_model(cut / "checkpoint")
    for (n, a), (_, b) in zip(m_full.state_dict().items(), m_cut.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    ev = {
        name: [r for r in map(json.loads, (d / "metrics.jsonl").open()) if "val_loss_topk" in r]
        for name, d in (("full", full), ("cut", cut))
    }
    assert [r["step"] for r in ev["cut"]] == [8] and ev["cut"] == ev["full"]
    with pytest.raises(ValueError, match="checkpoint_every"):
        TrainConfig(checkpoint_every=-1)


def test_a_checkpoint_between_log_steps_keeps_the_unlogged_training_time(
    corpus, tmp_path, monkeypatch
):
    """Training time is banked at log steps; a checkpoint between them (step 3, logs every 5)
    must still hold the time of every step it holds, or a resumed run's train_time_s drops it."""
    import time

    import mixture_of_depths.train.loop as tr

    real_step, pause = tr._train_step, 0.05

    def slow_step(run, step):  # noqa: ANN001, ANN202
        if step == 3:  # step 4: killed after the step-3 checkpoint
            raise KeyboardInterrupt
        time.sleep(pause)  # a floor under each step's training time
        return real_step(run, step)

    monkeypatch.setattr(tr, "_train_step", slow_step)
    out = tmp_path / "run"
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        train(MoDConfig(**TINY), tc(corpus, out, steps=6, eval_every=6, log_every=5,
                                    checkpoint_every=3), progress=False)  # fmt: skip
    wall = time.perf_counter() - t0
    state = json.loads((out / "checkpoint" / "trainer.json").read_text())
    assert state["step"] == 3
    assert 3 * pause <= state["elapsed_s"] <= wall


def test_checkpoint_round_trip_gives_identical_logits(tmp_path: Path):
    for tie in (True, False):
        cfg = MoDConfig(**TINY, tie_embeddings=tie, routing="staggered", causal_router="predictor")
        torch.manual_seed(1)
        model = MoDTransformer(cfg)
        d = save_checkpoint(tmp_path / f"ck{tie}", model, cfg, tokenizer=ByteTokenizer())
        loaded, cfg2 = load_model(d)
        assert cfg2 == cfg
        x = torch.randint(0, cfg.vocab_size, (3, 20))
        for routing in ("topk", "causal"):
            assert torch.equal(model(x, routing=routing).logits, loaded(x, routing=routing).logits)
        assert loaded.lm_head.weight is loaded.embed.weight or not tie


def test_checkpoint_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cfg = MoDConfig(**TINY)
    model = MoDTransformer(cfg)
    d = save_checkpoint(tmp_path / "ck", model, cfg)
    before = (d / "model.safetensors").read_bytes()
    with torch.no_grad():
        model.embed.weight.add_(1.0)

    def boom(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr("mixture_of_depths.runtime.checkpoint.write_json", boom)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "ck", model, cfg)
    assert (d / "model.safetensors").read_bytes() == before  # old checkpoint intact
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp directory left behind


def test_lr_schedule_warmup_then_cosine():
    """Linear warm-up to lr, then a cosine down to lr * min_lr_ratio, reached at the last step."""
    t = TrainConfig(steps=101, warmup_steps=10, lr=2.0, min_lr_ratio=0.1)
    lrs = [lr_at(s, t) for s in range(t.steps)]
    assert lrs[:10] == pytest.approx([0.2 * (s + 1) for s in range(10)])  # linear warm-up
    assert lrs[10] == pytest.approx(2.0) and lrs[-1] == pytest.approx(0.2)
    decay = lrs[10:]  # 91 steps, progress 0, 1/90, ..., 1
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    # A cosine from max to min is point-symmetric about its middle: lr(p) + lr(1 - p) = max + min.
    for i in range(len(decay)):
        assert decay[i] + decay[-1 - i] == pytest.approx(2.0 + 0.2)
    assert decay[45] == pytest.approx((2.0 + 0.2) / 2)
    assert lr_at(0, TrainConfig(steps=5, warmup_steps=0, lr=1.0)) == pytest.approx(1.0)
    one = TrainConfig(steps=11, warmup_steps=10, lr=1.0, min_lr_ratio=0.25)
    assert lr_at(10, one) == pytest.approx(0.25)  # a single decayed step is also the last


def test_gradient_clipping_happens_before_the_step(corpus: Path, tmp_path: Path, monkeypatch):
    """With a tiny clip norm the logged (pre-clip) norm is large but the update is bounded: the
    LM's gradient to the clip norm, and a predictor's, clipped on its own, to it as well (both
    together to sqrt(2) times it)."""
    seen = []
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **kw):
        total = torch.sqrt(
            sum(
                p.grad.pow(2).sum()
                for g in self.param_groups
                for p in g["params"]
                if p.grad is not None
            )
        )
        seen.append(total.item())
        return real_step(self, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    for router, bound in (("aux_loss", 1e-3), ("predictor", 2**0.5 * 1e-3)):
        seen.clear()
        cfg = MoDConfig(**TINY, causal_router=router)
        train(cfg, tc(corpus, tmp_path / router, steps=3, grad_clip=1e-3), progress=False)
        assert seen and all(n <= bound * 1.0001 for n in seen), (router, seen)


def test_train_errors_are_clear(corpus: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="seq_len 64 exceeds"):
        train(MoDConfig(**TINY), tc(corpus, tmp_path / "o", seq_len=64), progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        TrainConfig(tokenizer="words")
    with pytest.raises(FileNotFoundError):
        train(None, tc(corpus, tmp_path / "nothing"), resume=True, progress=False)


def test_a_capacity_warmup_longer_than_the_run_is_refused(corpus: Path, tmp_path: Path, capsys):
    """Longer than --steps, the warm-up never reaches the model's capacity: refused, naming both
    values; as long as the run is fine, and a resume that extends --steps keeps it."""
    from mixture_of_depths.train import resume_config

    with pytest.raises(ValueError, match="--capacity-warmup 11 is longer than --steps 10"):
        TrainConfig(steps=10, capacity_warmup=11)
    assert TrainConfig(steps=10, capacity_warmup=10).capacity_warmup == 10
    argv = ["train", "--steps", "4", "--capacity-warmup", "5", "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    assert "--capacity-warmup 5 is longer than --steps 4" in capsys.readouterr().err
    out = tmp_path / "run"
    train(MoDConfig(**TINY), tc(corpus, out, steps=3, capacity_warmup=3), progress=False)
    assert resume_config(out, {"steps": 6}).capacity_warmup == 3


def test_cli_train_eval_resume_smoke(corpus: Path, tmp_path: Path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        "--preset",
        "tiny",
        "--d-model",
        "32",
        "--n-heads",
        "2",
        "--max-seq-len",
        "32",
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--eval-batches",
        "1",
        "--batch-size",
        "2",
        "--skipped-kv",
        "residual",
        "--no-progress",
        "--json",
    ]
    assert main(args) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out)  # stdout is the JSON alone (for jq)
    assert "step 2: val loss top-k" in printed.err  # the evaluation lines go to stderr
    assert summary["steps"] == 4 and set(summary["routing_accuracy"]) == {"1", "3"}
    assert json.loads((out / "checkpoint" / "config.json").read_text())["skipped_kv"] == "residual"
    assert (out / "checkpoint" / "model.safetensors").exists() and (out / "loss.png").exists()
    assert main(["eval", str(out / "checkpoint"), "--batches", "1", "--batch-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "validation loss" in text and "layer 1: recall" in text and "paper's accuracy" in text
    # the run folder stands for its checkpoint (mod eval runs/mod)
    assert main(["eval", str(out), "--batches", "1", "--batch-size", "2"]) == 0
    assert capsys.readouterr().out == text
    model, _ = load_model(out)
    assert not model.training  # ready to evaluate, as from_pretrained returns a model
    ev = ["eval", str(out / "checkpoint"), "--batches", "1", "--prefill-calibration"]
    assert main([*ev, "--json"]) == 0
    pc = json.loads(capsys.readouterr().out)["prefill_calibration"]
    assert pc["loss_gap"] == pytest.approx(pc["loss_topk_prefill"] - pc["loss_causal_prefill"])
    assert main(ev) == 0 and "prompt decisions that differ" in capsys.readouterr().out
    assert main(["train", "--out", str(out), "--resume", "--steps", "6", "--no-progress"]) == 0
    assert max(losses(out)) == 6
    assert main(["presets"]) == 0 and "small-dense" in capsys.readouterr().out


def test_cli_bad_config_is_a_clear_error(capsys, tmp_path: Path):
    assert main(["train", "--capacity", "1.5", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "capacity must be in (0, 1], got 1.5" in err
    assert main(["train", "--layer-pattern", "DX", "--out", str(tmp_path / "x")]) == 2
    assert "'X'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_checkpoint_files_are_world_readable_like_open(tmp_path: Path):
    cfg = MoDConfig(**TINY)
    d = save_checkpoint(tmp_path / "ck", MoDTransformer(cfg), cfg)
    mask = os.umask(0)
    os.umask(mask)
    assert (d / "config.json").stat().st_mode & 0o777 == 0o666 & ~mask


def test_resume_refuses_changed_settings_and_new_run_refuses_to_overwrite(corpus, tmp_path):
    cfg = MoDConfig(**TINY)
    out = tmp_path / "run"
    train(cfg, tc(corpus, out, steps=3), progress=False)
    with pytest.raises(ValueError, match="lr: 0.003 -> 0.01"):
        train(None, tc(corpus, out, steps=6, lr=1e-2), resume=True, progress=False)
    with pytest.raises(ValueError, match="already holds a run"):
        train(cfg, tc(corpus, out, steps=3), progress=False)
    train(cfg, tc(corpus, out, steps=3), overwrite=True, progress=False)  # explicit: allowed


def test_resume_refuses_other_data(corpus, tmp_path):
    out = tmp_path / "run"
    train(MoDConfig(**TINY), tc(corpus, out, steps=3), progress=False)
    f = corpus / "f00.py"
    f.write_text(f.read_text() + "x = 1\n")
    with pytest.raises(ValueError, match="training data differ"):
        train(None, tc(corpus, out, steps=6), resume=True, progress=False)


def test_resume_survives_a_half_written_log_line(corpus, tmp_path):
    cfg = MoDConfig(**TINY)
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(cfg, tc(corpus, full), progress=False)
    train_until(cfg, tc(corpus, cut), stop_at=3)
    with (cut / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 4, "loss": 1.2')  # a crash in the middle of a write
    train(None, tc(corpus, cut), resume=True, progress=False)
    assert losses(cut) == losses(full)


def test_predictor_gradient_does_not_rescale_the_lm_update(corpus, tmp_path):
    """Clipping is active (tiny max norm); the predictor's loss weight changes only its own
    gradient, so every other parameter must end up bit-identical."""
    finals = []
    for w in (0.1, 100.0):
        cfg = MoDConfig(**TINY, causal_router="predictor", aux_loss_weight=w)
        out = tmp_path / f"w{w}"
        train(cfg, tc(corpus, out, steps=2, grad_clip=1e-3), progress=False)
        model, _ = load_model(out / "checkpoint")
        finals.append({n: p for n, p in model.state_dict().items() if ".predictor." not in n})
    assert finals[0].keys() == finals[1].keys()
    for n in finals[0]:
        assert torch.equal(finals[0][n], finals[1][n]), n


@pytest.mark.slow  # torch.compile of a training step (~25 s); compiled = eager also in tests/bench
def test_train_compile_matches_eager(corpus: Path, tmp_path: Path):
    """`mod train --compile`: the compiled model trains to the eager run's losses."""
    cfg = MoDConfig(**TINY)
    train(cfg, tc(corpus, tmp_path / "eager", steps=3, eval_every=3), progress=False)
    torch._dynamo.reset()
    train(cfg, tc(corpus, tmp_path / "comp", steps=3, eval_every=3, compile=True), progress=False)
    want, got = losses(tmp_path / "eager"), losses(tmp_path / "comp")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-4, abs=1e-5), step


def test_cli_generate_streams_what_generate_samples(corpus: Path, tmp_path: Path, capsys):
    """`mod generate`: plain streaming prints the prompt and exactly the greedy continuation that
    `generate` samples from the same checkpoint; --show-routing prints every token coloured by
    the routed blocks it took (in colour only when asked: stdout here is no terminal), with a
    legend and the take-rate per routed layer of the same run."""
    from mixture_of_depths.data import load_tokenizer
    from mixture_of_depths.generate import generate
    from mixture_of_depths.routing import calibrate_predictors

    cfg = MoDConfig(**TINY, causal_router="predictor")
    train(cfg, tc(corpus, tmp_path / "run", steps=2, eval_every=2), progress=False)
    ckpt = tmp_path / "run" / "checkpoint"
    model, cfg = load_model(ckpt)
    tok = load_tokenizer(ckpt)
    prompt = "def x = y"
    # About half the tokens take the routed block, so the colours and shares say something.
    calibrate_predictors(model, torch.tensor([tok.encode("def x in y ( ) for self if z")]), 0.5)
    save_checkpoint(ckpt, model, cfg, tokenizer=tok)
    n = 12
    want = generate(
        model, [tok.encode(prompt)], n, temperature=0, eos_id=tok.eot_id, return_routing=True
    )
    ids = [t for t in want.tokens[0] if t != tok.eot_id]
    capsys.readouterr()
    base = ["generate", str(ckpt), "--prompt", prompt, "--temperature", "0"]
    assert main([*base, "--max-new-tokens", str(n)]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(ids) + "\n"
    assert main([*base, "--max-new-tokens", str(n), "--show-routing"]) == 0
    shown = capsys.readouterr().out
    assert "\x1b[" not in shown  # not a terminal: no colour codes
    assert main([*base, "--max-new-tokens", str(n), "--show-routing", "--color", "always"]) == 0
    plain = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)
    assert plain == shown and plain.startswith(prompt + tok.decode(want.tokens[0]))
    fed = want.routing[0][: len(tok.encode(prompt)) + len(ids)]  # a final EOS is not fed
    took, n_fed = int(fed[:, 0].sum()), len(fed)
    assert 0 < took < n_fed  # precondition: some tokens took the routed block, some skipped it
    assert "routed blocks taken per token (of 1)" in plain
    assert (
        f"take-rates over the {n_fed} tokens fed (prompt and generated): L1 {took}/{n_fed} "
        in plain
    )
    assert main([*base, "--max-new-tokens", "0"]) == 2  # a clear error, not a crash


def test_expert_runs_log_what_the_experts_ran(corpus: Path, tmp_path: Path):
    """Per expert layer, training logs the share of slots that ran a real expert (at most the
    capacity's bound) and evaluation the share of tokens; without no-ops or a capacity, both 1."""
    drop = MoDConfig(
        **{**TINY, "n_experts": 4, "expert_capacity_factor": 0.5, "layer_pattern": "D"}
    )
    s = train(drop, tc(corpus, tmp_path / "drop"), progress=False)
    rows = [json.loads(x) for x in (tmp_path / "drop" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["expert_share"] for r in rows if "expert_share" in r]
    assert len(logged) == 6 and set(logged[0]) == {"0", "1"}
    bound = estimate_flops(drop, 32, batch_size=4).layers[0].expert_share
    assert all(0 < v <= bound for r in logged for v in r.values())
    assert s["train_expert_share"] == pytest.approx(
        {k: sum(r[k] for r in logged) / 6 for k in ("0", "1")}
    )
    assert s["expert_take_rate"] == {"0": 1.0, "1": 1.0}  # evaluation never drops
    plain = MoDConfig(**{**TINY, "n_experts": 2, "layer_pattern": "DR"})
    s = train(plain, tc(corpus, tmp_path / "plain", steps=2, eval_every=2), progress=False)
    assert s["train_expert_share"] == {"0": 1.0, "1": 1.0}
    assert s["expert_take_rate"]["0"] == 1.0
    assert s["expert_take_rate"]["1"] == pytest.approx(s["causal_take_rate"]["1"])


def test_every_evaluation_logs_the_copy_probe_and_mod_eval_prints_it(corpus, tmp_path, capsys):
    """The copy probe of each evaluation is that of the model at that step: the last one equals
    the probe recomputed on the saved checkpoint, and `mod eval` prints the same."""
    from mixture_of_depths.probes import copy_probe

    out = tmp_path / "run"
    summary = train(MoDConfig(**TINY), tc(corpus, out, seq_len=32), progress=False)
    rows = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss_topk" in r]
    assert len(evals) == 2 and all("score" in r["copy_probe"] for r in evals)
    model, _ = load_model(out / "checkpoint")
    again = copy_probe(model, length=32)
    logged = evals[-1]["copy_probe"]
    for key in ("loss_first", "loss_second", "score"):
        assert logged[key] == pytest.approx(again[key], rel=1e-6, abs=1e-7)
    assert logged["take_first"] == again["take_first"]
    assert summary["copy_probe"] == evals[-1]["copy_probe"]
    assert main(["eval", str(out / "checkpoint"), "--data", str(corpus)]) == 0
    assert f"copy probe: score {again['score']:+.3f} nats" in capsys.readouterr().out
