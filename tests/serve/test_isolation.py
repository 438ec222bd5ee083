"""One bad request never fails another (docs/serving.md, "Faults"): an error while computing one
row (its sampling, NaN logits, a forward that fails on its tokens) ends that request alone with
an error, returns its pages, and the rows beside it finish exactly as they would alone; a tiny
temperature is greedy, in the engine as in `generate`."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import prompts, serve_model

import mixture_of_depths.serve.engine as engine_module
from mixture_of_depths.generate import GREEDY_BELOW, generate, generate_reference, sample_next
from mixture_of_depths.serve.engine import Engine
from mixture_of_depths.serve.types import SamplingParams

GREEDY = dict(temperature=0.0, stop_at_eos=False)
POISON = 60  # a prompt ending in this token poisons its row (see `poison`)


def _engine(model, **kw) -> Engine:  # noqa: ANN001
    return Engine(model, None, **{"max_rows": 4, "page_size": 4, "prefill_chunk": 8, **kw})


def _run(engine: Engine) -> None:
    for _ in range(10_000):  # bounded: every request here ends in far fewer steps
        if not engine.step():
            return
    raise AssertionError("the engine did not go idle")


def _all_pages_back(engine: Engine) -> None:
    m = engine.metrics()
    assert m["requests_running"] == 0 and m["queue_depth"] == 0
    assert set(m["kv_pages_in_use"].values()) == {0} and m["kv_bytes_in_use"] == 0


def _reference(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    return generate_reference(model, [prompt], n).tokens[0]


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-30, GREEDY_BELOW / 2])
def test_a_tiny_temperature_is_greedy_in_generate_and_sample_next(temperature):
    model = serve_model("predictor")
    p = prompts((6,))[0]
    got = generate(model, [p], 8, temperature=temperature, seed=3).tokens[0]
    assert got == _reference(model, p, 8)
    logits = torch.tensor([[1.0, 3.0, 2.0], [50.0, -1e4, 49.0]])
    assert sample_next(logits, temperature).tolist() == [1, 0]


def test_a_tiny_temperature_beside_other_requests_is_greedy_and_fails_none():
    model = serve_model("predictor")
    ps = prompts((5, 9, 3, 7))
    engine = _engine(model)
    reqs = [engine.submit(p, SamplingParams(max_tokens=6, **GREEDY)) for p in ps[:3]]
    tiny = engine.submit(ps[3], SamplingParams(max_tokens=6, temperature=1e-40, seed=1,
                                               stop_at_eos=False))  # fmt: skip
    _run(engine)
    for p, r in zip(ps, [*reqs, tiny], strict=True):
        assert r.result(0)[2] == "length"
        assert r.result(0)[0] == _reference(model, p, 6)
    _all_pages_back(engine)


def poison(model, how: str) -> None:  # noqa: ANN001
    """Make the model fail on a row whose token is POISON: its logits NaN ("nan"), or the whole
    forward raising ("raise", as a kernel error on one row's input would)."""
    real = model.forward

    def forward(idx, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        hit = idx[:, -1] == POISON if kw.get("lengths") is None else _last(idx, kw["lengths"])
        if how == "raise" and bool(hit.any()):
            raise RuntimeError("injected: a forward that fails on one row's tokens")
        out = real(idx, *args, **kw)
        if how == "nan" and bool(hit.any()):
            out.logits[hit.to(out.logits.device)] = float("nan")
        return out

    model.forward = forward


def _last(idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Whether each right-padded row's last real token is POISON."""
    return idx[torch.arange(len(idx)), lengths.to(idx.device) - 1] == POISON


@pytest.mark.parametrize("how", ["nan", "raise", "sampling", "text", "text-end"])
def test_an_error_in_one_row_fails_that_request_alone(how, monkeypatch):
    """A row whose logits are NaN, whose forward raises, whose sampling raises, or whose text
    fails to decode (a tokenizer's error, on a token or on the text held back at the end) ends
    with "error"; the others, in the same steps, equal their reference; every page comes back;
    the engine serves the next request."""
    model = serve_model("predictor")
    good = prompts((5, 9, 3), seed=4)
    bad = prompts((4,), seed=5)[0] + [POISON]
    expected = [_reference(model, p, 7) for p in good]
    assert all(POISON not in p + e for p, e in zip(good, expected, strict=True))
    if how == "sampling":
        real = engine_module.sample_next

        def sample(logits, temperature, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if temperature == 0.5:
                raise RuntimeError("injected: sampling failed for one row")
            return real(logits, temperature, *a, **kw)

        monkeypatch.setattr(engine_module, "sample_next", sample)
    elif how in ("nan", "raise"):
        poison(model, how)
    engine = _engine(model)
    reqs = [engine.submit(p, SamplingParams(max_tokens=7, **GREEDY)) for p in good[:2]]
    settings = dict(temperature=0.5) if how == "sampling" else GREEDY
    failed = engine.submit(bad, SamplingParams(max_tokens=7, **settings))
    if how == "text":  # its first token's text fails, after the batch's tokens are sampled

        def text_fails(token: int) -> tuple[str, bool]:
            raise RuntimeError("injected: the tokenizer failed on this row's token")

        failed.text.add = text_fails
    if how == "text-end":  # the text held back fails at its finish ("length")

        def flush_fails() -> str:
            raise RuntimeError("injected: the tokenizer failed on this row's last text")

        failed.text.flush = flush_fails
    reqs.append(engine.submit(good[2], SamplingParams(max_tokens=7, **GREEDY)))
    engine.step()  # the bad row is prefilled beside the good ones, in one forward
    _run(engine)
    assert failed.result(0)[2] == "error"
    for e, r in zip(expected, reqs, strict=True):
        assert r.result(0)[2] == "length", how
        assert r.result(0)[0] == e, how
    _all_pages_back(engine)
    again = engine.submit(good[0], SamplingParams(max_tokens=7, **GREEDY))
    _run(engine)
    assert again.result(0)[0] == expected[0]


@pytest.mark.parametrize("static", [False, True], ids=["entries", "static-step"])
def test_a_sampling_nan_row_fails_alone_beside_seeded_sampled_rows(static):
    """A row sampling at a temperature (top-k, top-p) whose logits are NaN fails alone (it
    samples from zeros in the batched step, then fails: no device assert, no error for the
    others); the seeded sampled rows beside it, each with its own generator, equal
    `generate(..., seed=)` for their prompt alone, through the entries or the static step."""
    model = serve_model("predictor")
    good = prompts((5, 9, 3), seed=4)
    settings = [
        dict(temperature=0.8, seed=1),
        dict(temperature=1.3, top_k=5, seed=2),
        dict(temperature=0.7, top_p=0.8, seed=3),
    ]
    expected = [generate(model, [p], 7, **s).tokens[0] for p, s in zip(good, settings, strict=True)]
    assert all(POISON not in p + e for p, e in zip(good, expected, strict=True))
    poison(model, "nan")
    engine = _engine(model, static_decode=static)
    reqs = [
        engine.submit(p, SamplingParams(max_tokens=7, stop_at_eos=False, **s))
        for p, s in zip(good[:2], settings, strict=False)
    ]
    bad = prompts((4,), seed=5)[0] + [POISON]
    failed = engine.submit(bad, SamplingParams(max_tokens=7, temperature=0.9, top_k=3, top_p=0.5))
    last = SamplingParams(max_tokens=7, stop_at_eos=False, **settings[2])
    reqs.append(engine.submit(good[2], last))
    _run(engine)
    assert failed.result(0)[2] == "error"
    assert "not finite" in str(list(failed.events(0))[-1].error)
    assert [r.result(0)[0] for r in reqs] == expected
    _all_pages_back(engine)
