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
        for pattern, routing in (("DR", "joint"), ("R", "joint"), ("DR", "mlp_kv")):
            model = convert(
                hf.state_dict(), hf.config.to_dict(), pattern, capacity=1.0, routing=routing
            ).eval()
            assert model.config.router_gate == "straight_through"
            assert model.config.routing == routing
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
    assert "2 routed at capacity 1.0, joint routing" in capsys.readouterr().out
    model, cfg = load_model(out)
    assert isinstance(load_tokenizer(out), ByteTokenizer)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(x, routing="topk").logits, hf(x).logits, rtol=0, atol=1e-5
        )
    kv = tmp_path / "mod-kv"  # every token queries, the takers are keys: at 1.0, every token
    assert main([*args[:4], str(kv), *args[5:], "--routing", "mlp_kv"]) == 0
    assert "mlp_kv routing" in capsys.readouterr().out
    model, cfg = load_model(kv)
    assert cfg.routing == "mlp_kv"
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


# -- what a folder names, and what is wrong with it (issue 35) ------------------------------------
def llama_folder(path, seed: int = 0):  # noqa: ANN201
    """A dense model of ours written as a Llama folder without transformers: config.json,
    model.safetensors and the byte tokenizer as byte-level BPE (what `mod export --llama` writes).
    Returns the folder and the model."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from mixture_of_depths.convert import bytes_to_unicode, llama_config, to_llama

    torch.manual_seed(seed)
    dense = MoDTransformer(MoDConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4,
                                     max_seq_len=64, layer_pattern="D"))  # fmt: skip
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(llama_config(dense.config)))
    save_file(to_llama(dense), path / "model.safetensors", {"format": "pt"})
    vocab = {ch: b for b, ch in bytes_to_unicode().items()} | {"<|endoftext|>": 256}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>"])
    tk.save(str(path / "tokenizer.json"))
    return path, dense


def shard(folder, weights: dict, files: int = 2) -> None:
    """`weights` written as a sharded folder: `files` shards and model.safetensors.index.json."""
    from safetensors.torch import save_file

    names, weight_map = sorted(weights), {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {n: weights[n] for n in names[i::files]}
        save_file(part, folder / file, {"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def converted_weights(src, out, capsys) -> tuple[dict, str]:
    assert main(["convert", "--from-hf", str(src), "--out", str(out), "--capacity", "1.0"]) == 0
    err = capsys.readouterr().err
    return load_model(out)[0].state_dict(), err


def test_convert_reads_exactly_the_weights_the_folder_names(tmp_path, capsys):
    """The index's files when there is one, else model.safetensors; any other .safetensors (a
    stale single file beside shards, Mistral's consolidated.safetensors) is not read, and a note
    names it."""
    from safetensors.torch import load_file, save_file

    src, dense = llama_folder(tmp_path / "llama")
    want = dense.state_dict()
    weights = load_file(src / "model.safetensors")
    stale = {n: torch.zeros_like(t) for n, t in weights.items()}
    save_file(stale, src / "consolidated.safetensors")  # sorts before model.safetensors
    got, err = converted_weights(src, tmp_path / "one", capsys)
    assert torch.equal(got["blocks.0.attn.wo.weight"], want["blocks.0.attn.wo.weight"])
    assert f"{src / 'consolidated.safetensors'} is not read" in err
    # Shards and their index; a stale model.safetensors (sorting after the shards) is ignored.
    shard(src, weights)
    save_file(stale, src / "model.safetensors")
    got, err = converted_weights(src, tmp_path / "sharded", capsys)
    assert all(torch.equal(got[k], want[k]) for k in want if k in got and ".router" not in k)
    assert f"{src / 'model.safetensors'} is not read" in err
    for name in ("model.safetensors", "consolidated.safetensors", "model.safetensors.index.json"):
        (src / name).unlink()
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no model.safetensors or model.safetensors.index.json in" in err, err


def pickle_that_writes(marker) -> bytes:
    """A pickle whose unpickling writes `marker`: proof that something unpickled it."""
    import pickle
    from pathlib import Path

    class Boom:
        def __reduce__(self):  # noqa: ANN204
            return (Path.write_text, (marker, "unpickled!"))

    return pickle.dumps(Boom())


def test_convert_refuses_pickled_weights_without_reading_them(tmp_path, capsys):
    src, _ = llama_folder(tmp_path / "llama")
    (src / "model.safetensors").unlink()
    marker = tmp_path / "marker"
    (src / "pytorch_model.bin").write_bytes(pickle_that_writes(marker))
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'pytorch_model.bin'} found: convert it to safetensors first" in err, err
    assert "Traceback" not in err and not marker.exists()


def _damage(path, how: str) -> None:
    """Damage one file of a folder: cut in half, emptied, a tensor dropped, config.json's fields
    changed (``field=JSON``, ``field=`` to drop it), or replaced by literal text."""
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how.startswith("drop "):
        from safetensors.torch import load_file, save_file

        weights = load_file(path)
        del weights[how.removeprefix("drop ")]
        save_file(weights, path)
    elif "=" in how and not how.startswith(("{", "[")):
        cfg = json.loads(path.read_text())
        name, value = how.split("=", 1)
        if value:
            cfg[name] = json.loads(value)
        else:
            del cfg[name]
        path.write_text(json.dumps(cfg))
    else:
        path.write_text(how)


UP = "model.layers.1.mlp.up_proj.weight"
FOLDER_DAMAGE = [  # (file, how to damage it, what the one line must say)
    ("model.safetensors", "truncate", "model.safetensors: not a readable safetensors file"),
    ("model.safetensors", "", "0 bytes, too short for a safetensors header"),
    ("model.safetensors", "garbage " * 9, "model.safetensors: not a readable safetensors file"),
    ("model.safetensors", f"drop {UP}", f"no tensor {UP!r}, which config.json implies"),
    ("config.json", "[]", "config.json: expected a JSON object, found list"),
    ("config.json", '{"model_type": "llama",', "config.json: not valid JSON (Expecting"),
    ("config.json", "hidden_size=", "config.json: hidden_size is missing"),
    ("config.json", 'hidden_size="32"', 'hidden_size must be a positive integer, got "32"'),
    ("config.json", "rms_norm_eps=[1]", "config.json: rms_norm_eps must be a number, got [1]"),
    ("config.json", "vocab_size=300", "model.safetensors: 'model.embed_tokens.weight' has shape "
     "[257, 32], config.json implies [300, 32]"),
    ("tokenizer.json", '{"model": 3', "tokenizer.json: not a tokenizer the tokenizers library"),
]  # fmt: skip


@pytest.mark.parametrize("name,how,message", FOLDER_DAMAGE)
def test_a_malformed_folder_is_one_line_naming_the_file(tmp_path, capsys, name, how, message):
    src, _ = llama_folder(tmp_path / "llama")
    _damage(src / name, how)
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(src) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX_DAMAGE = [  # (file, how to damage it, what the one line must say)
    ("model.safetensors.index.json", "{", "model.safetensors.index.json: not valid JSON"),
    ("model.safetensors.index.json", '{"weight_map": []}', 'expected a non-empty "weight_map"'),
    ("model.safetensors.index.json", 'weight_map={"x": "../elsewhere.safetensors"}',
     "'x' maps to \"../elsewhere.safetensors\", not a .safetensors file of this folder"),
    (SHARD2, "delete", f"index.json: it names {SHARD2}, which is not in"),
    (SHARD1, "drop model.embed_tokens.weight", f"{SHARD1}: it holds no tensor "
     "'model.embed_tokens.weight', which model.safetensors.index.json maps to it"),
    (SHARD2, "truncate", f"{SHARD2}: not a readable safetensors file"),
]  # fmt: skip


@pytest.mark.parametrize("name,how,message", INDEX_DAMAGE)
def test_a_broken_index_or_shard_is_named(tmp_path, capsys, name, how, message):
    from safetensors.torch import load_file

    src, _ = llama_folder(tmp_path / "llama")
    shard(src, load_file(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    if how == "delete":
        (src / name).unlink()
    else:
        _damage(src / name, how)
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


@pytest.mark.parametrize("command", ["generate", "eval", "inspect"])
def test_commands_that_load_a_checkpoint_say_how_to_convert_a_hf_folder(tmp_path, capsys, command):
    src, _ = llama_folder(tmp_path / "llama")
    args = {
        "generate": [str(src), "--prompt", "def"],
        "eval": [str(src), "--data", str(tmp_path)],
        "inspect": [str(src)],
    }[command]
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    want = f"{src} is a Hugging Face folder, not a checkpoint: run `mod convert --from-hf {src}"
    assert want in err and "unknown MoDConfig fields" not in err, err
