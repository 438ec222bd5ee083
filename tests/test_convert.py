"""Pretrained dense Llama-family models converted to MoD (and our dense models to Llama).

The oracle is transformers' own `LlamaForCausalLM` / `MistralForCausalLM`, randomly initialised
in the test (no download): converted at capacity 1.0 with the straight-through gate, every token
takes every block and the MoD model must give the original's logits (float32, within 1e-5)."""

from __future__ import annotations

import json

import pytest
import torch

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cli import main
from mixture_of_depths.convert import UnsupportedModel, convert, mod_config
from mixture_of_depths.data import BPETokenizer, ByteTokenizer, load_tokenizer
from mixture_of_depths.runtime.checkpoint import load_model, save_checkpoint


def needs_transformers():  # noqa: ANN201
    """transformers (the [hf] extra) for the tests that build its models; the rest run without."""
    return pytest.importorskip("transformers", minversion="5")


SHAPE = dict(
    vocab_size=ByteTokenizer.vocab_size, hidden_size=32, intermediate_size=64,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500000.0,
)  # fmt: skip


def dense_hf(kind: str, tie: bool, **kw) -> torch.nn.Module:
    """A random tiny Llama or Mistral, its weights spread wider than at init (std 0.02 would
    leave logits near zero, where a wrong mapping could hide)."""
    transformers = needs_transformers()
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[kind]
    extra = {"sliding_window": None} if kind == "mistral" else {}
    cfg = cls(**{**SHAPE, "tie_word_embeddings": tie, **extra, **kw})
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind.capitalize()}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3 if "embed" in name or "lm_head" in name else 0.15)
    return model


def tokens(T: int = 40) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, T), generator=torch.Generator().manual_seed(3))


@pytest.mark.hf
@pytest.mark.parametrize("kind", ["llama", "mistral"])
@pytest.mark.parametrize("tie", [False, True])
def test_converted_at_full_capacity_gives_the_original_logits(kind, tie):
    hf = dense_hf(kind, tie)
    x = tokens()
    with torch.no_grad():
        want = hf(x).logits
        for pattern in ("DR", "R"):
            model = convert(hf.state_dict(), hf.config.to_dict(), pattern, capacity=1.0).eval()
            assert model.config.router_gate == "straight_through"
            assert model.config.rope_theta == 500000.0 and model.config.norm_eps == 1e-6
            got = model(x, routing="topk").logits
            assert want.abs().max() > 1  # logits large enough for a wrong mapping to show
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # At capacity 0.125 the routed blocks skip most tokens: the logits move (routing is real).
    low = convert(hf.state_dict(), hf.config.to_dict(), "DR", capacity=0.125).eval()
    with torch.no_grad():
        assert (low(x, routing="topk").logits - want).abs().max() > 1e-2


def test_the_straight_through_gate_is_one_forward_and_trains_the_router():
    cfg = MoDConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
                    layer_pattern="DR", capacity=1.0, router_gate="straight_through")  # fmt: skip
    torch.manual_seed(0)
    model = MoDTransformer(cfg).double()
    dense = MoDTransformer(cfg.dense_twin()).double()
    dense.load_state_dict(model.state_dict(), strict=False)
    x = tokens(24) % 61
    out = model(x, targets=x, routing="topk")
    assert torch.equal(out.logits, dense(x, routing="topk").logits)  # g = 1 exactly
    out.lm_loss.backward()
    router = model.blocks[1].router["block"].weight
    assert router.grad is not None and router.grad.abs().max() > 0


@pytest.mark.hf
def test_convert_through_folders_and_the_cli(tmp_path, capsys):
    """A Llama folder as transformers writes it (weights, config, a tokenizer) converted by
    `mod convert`; our dense model exported by `mod export --llama` and read by transformers."""
    transformers = needs_transformers()
    from mixture_of_depths.hf import hf_tokenizer

    hf = dense_hf("llama", tie=False)
    src = tmp_path / "llama"
    hf.save_pretrained(src)
    hf_tokenizer(ByteTokenizer()).save_pretrained(src)
    out = tmp_path / "mod"
    args = ["convert", "--from-hf", str(src), "--out", str(out), "--capacity", "1.0"]
    assert main(args) == 0
    assert "2 routed at capacity 1.0" in capsys.readouterr().out
    model, cfg = load_model(out)
    assert isinstance(load_tokenizer(out), ByteTokenizer)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(x, routing="topk").logits, hf(x).logits, rtol=0, atol=1e-5
        )
    assert main(args) == 2 and "not empty" in capsys.readouterr().err
    # Our dense model to the Llama layout: transformers' Llama computes our logits.
    dense = MoDTransformer(MoDConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4,
                                     max_seq_len=64, layer_pattern="D"))  # fmt: skip
    ckpt = save_checkpoint(tmp_path / "dense", dense, dense.config, tokenizer=ByteTokenizer())
    llama = tmp_path / "as_llama"
    assert main(["export", str(ckpt), "--llama", str(llama)]) == 0
    assert "Llama folder" in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    assert type(back).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(
            back(x).logits, dense.eval()(x, routing="topk").logits, rtol=0, atol=1e-5
        )
    routed = MoDTransformer(MoDConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4))
    ck2 = save_checkpoint(tmp_path / "routed", routed, routed.config, tokenizer=ByteTokenizer())
    assert main(["export", str(ck2), "--llama", str(tmp_path / "x")]) == 2
    assert "only dense models" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "qwen2"}, "biases"),
        ({"model_type": "gpt2"}, "only llama, mistral"),
        ({"attention_bias": True}, "no attention biases"),
        ({"hidden_act": "gelu"}, "SiLU"),
        ({"head_dim": 16}, "head_dim = 8"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16"),
    ],
)
def test_what_cannot_be_converted_exactly_is_refused(change, message):
    hf = {"model_type": "llama", **SHAPE, **change}
    with pytest.raises(UnsupportedModel, match=message):
        mod_config(hf)


def test_a_bpe_tokenizer_keeps_another_end_of_text(tmp_path):
    (tmp_path / "t.txt").write_text("hello world </s> again " * 50)
    trained = BPETokenizer.train([tmp_path / "t.txt"], vocab_size=300)
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(trained._json)
    tk.add_special_tokens(["</s>"])
    tok = BPETokenizer(tk, eot_token="</s>")
    tok.save(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["eot"] == "</s>"
    back = load_tokenizer(tmp_path)
    assert back.eot_id == tok.eot_id == tk.token_to_id("</s>")
    assert back.encode("hello world") == tok.encode("hello world")
