"""MoD models as Hugging Face transformers models (the `[hf]` extra; skipped without it).

Oracles: our own `generate` (greedy output token for token), our model's forward on each row
alone (padded batches), our model's losses, and the weights themselves (save/load round trip)."""

from __future__ import annotations

import pytest
import torch
from helpers import V, make_model, tiny_config

from mixture_of_depths import generate

transformers = pytest.importorskip("transformers", minversion="5")

pytestmark = pytest.mark.hf

from mixture_of_depths.hf import MoDCache, MoDForCausalLM, MoDHFConfig  # noqa: E402

PROMPTS = [[5, 7, 9, 11, 3, 4, 12], [1, 2], [8, 8, 8, 30]]


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.fixture(params=["aux_loss", "predictor", "mlp_kv"])
def hf_model(request) -> MoDForCausalLM:
    """A MoD model wrapped, by its causal router; "mlp_kv": routing="mlp_kv", the predictor."""
    over = {"routing": "mlp_kv"} if request.param == "mlp_kv" else {}
    cfg = tiny_config(causal_router="aux_loss" if request.param == "aux_loss" else "predictor",
                      **over)  # fmt: skip
    return MoDForCausalLM.from_mod(make_model(cfg).eval(), pad_token_id=0)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_through_transformers_equals_ours(hf_model, use_cache):
    """Left-padded batch, attention mask, EOS: token for token what `generate` gives (float64,
    so no argmax can flip on round-off between the two paths)."""
    ours = generate(hf_model.model, PROMPTS, max_new_tokens=8, temperature=0)
    ids, mask = left_padded(PROMPTS)
    out = hf_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, use_cache=use_cache
    )
    assert out[:, ids.shape[1] :].tolist() == ours.tokens
    eos = ours.tokens[0][2]  # row 0 stops at its third token; the others at theirs, if any
    ours = generate(hf_model.model, PROMPTS, max_new_tokens=8, temperature=0, eos_id=eos)
    out = hf_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8,
        eos_token_id=eos, use_cache=use_cache,
    )  # fmt: skip
    for row, want in zip(out[:, ids.shape[1] :].tolist(), ours.tokens, strict=True):
        assert row[: len(want)] == want
        assert all(t == 0 for t in row[len(want) :])  # padded after EOS


def test_sampling_runs_and_top_k_1_is_greedy(hf_model):
    ids, mask = left_padded(PROMPTS)
    greedy = hf_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=5
    )
    top1 = hf_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, top_k=1, max_new_tokens=5
    )
    assert torch.equal(greedy, top1)
    torch.manual_seed(0)
    sampled = hf_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.5, max_new_tokens=5
    )
    assert sampled.shape == greedy.shape and int(sampled.max()) < V


def test_the_cache_counts_positions_not_the_keys_a_routed_layer_holds(hf_model):
    ids, mask = left_padded(PROMPTS)
    cache = MoDCache()
    out = hf_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, cache=cache
    )
    seen = out.shape[1] - 1  # the last token is sampled, not fed
    assert cache.get_seq_length() == seen
    kv = cache.kv
    cfg = hf_model.model.config
    routed = [b.layer for b in hf_model.model.blocks if b.routed]
    dense = [b.layer for b in hf_model.model.blocks if not b.routed]
    real = [len(p) + 5 for p in PROMPTS]  # each row's own tokens: its prompt and 5 fed back
    for layer in dense:
        assert kv.lengths[layer].tolist() == real
    assert any(kv.lengths[layer].sum() < sum(real) for layer in routed)
    assert cfg.capacity < 1


def test_a_padded_forward_gives_each_row_what_it_gives_alone(hf_model):
    ids, mask = left_padded(PROMPTS)
    logits = hf_model(input_ids=ids, attention_mask=mask).logits
    P = ids.shape[1]
    for b, p in enumerate(PROMPTS):
        alone = hf_model.model(torch.tensor([p]), routing="causal").logits[0]
        torch.testing.assert_close(logits[b, P - len(p) :], alone, rtol=0, atol=1e-12)
    last = hf_model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    torch.testing.assert_close(last[:, 0], logits[:, -1], rtol=0, atol=1e-12)


def test_labels_give_our_losses(hf_model):
    x = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    targets = torch.cat([x[:, 1:], torch.full((2, 1), -100)], 1)
    got = hf_model(input_ids=x, labels=x).loss
    want = hf_model.model(x, targets=targets, routing="causal").lm_loss
    assert torch.equal(got, want)
    hf_model.train()
    got = hf_model(input_ids=x, labels=x).loss  # training: top-k routing, plus the aux loss
    want = hf_model.model(x, targets=targets, routing="topk").loss
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="padded batches .* are for evaluation"):
        hf_model(input_ids=x, attention_mask=torch.ones_like(x).index_fill(1, torch.tensor([0]), 0))


@pytest.mark.parametrize("tie", [True, False])
def test_save_pretrained_and_auto_from_pretrained_round_trip(tmp_path, tie):
    model = make_model(tiny_config(tie_embeddings=tie)).eval()
    hf = MoDForCausalLM.from_mod(model)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, MoDHFConfig) and config.mod_config == model.config
    assert config.hidden_size == model.config.d_model
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(back, MoDForCausalLM) and back.dtype == torch.float64
    want = hf.state_dict()
    assert back.state_dict().keys() == want.keys()
    assert all(torch.equal(v, want[k]) for k, v in back.state_dict().items())
    assert (back.model.lm_head.weight is back.model.embed.weight) == tie
    ids, mask = left_padded(PROMPTS)
    args = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=4)
    assert torch.equal(back.generate(**args), hf.generate(**args))


def test_what_transformers_cannot_do_with_a_mod_model_is_refused(hf_model):
    ids, mask = left_padded(PROMPTS)
    with pytest.raises(ValueError, match="beam search"):
        hf_model.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=2)
    holes = mask.clone()
    holes[0, -2] = 0
    with pytest.raises(ValueError, match="left-padded"):
        hf_model(input_ids=ids, attention_mask=holes)
    with pytest.raises(ValueError, match="prefill_routing"):
        MoDHFConfig(prefill_routing="random")


@pytest.mark.parametrize("kind, routing", [("byte", "joint"), ("bpe", "joint"), ("byte", "mlp_kv")])
def test_export_and_convert_back_through_the_cli(tmp_path, capsys, kind, routing):
    """`mod export --hf` writes a folder transformers loads (model and tokenizer, same ids);
    `mod convert --from-hf` brings it back to the same weights and tokenizer."""
    from mixture_of_depths.cli import main
    from mixture_of_depths.data import BPETokenizer, ByteTokenizer, load_tokenizer
    from mixture_of_depths.runtime.checkpoint import load_model, save_checkpoint

    text = "def f(x):\n    return 'héllo ☃' + x\n" * 20
    if kind == "byte":
        tokenizer = ByteTokenizer()
    else:
        (tmp_path / "t.txt").write_text(text)
        tokenizer = BPETokenizer.train([tmp_path / "t.txt"], vocab_size=300)
    cfg = tiny_config(vocab_size=tokenizer.vocab_size, routing=routing)
    model = make_model(cfg, dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=tokenizer)
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), "--hf", str(out)]) == 0
    assert "transformers folder" in capsys.readouterr().out
    assert "import mixture_of_depths.hf" in (out / "README.md").read_text()  # what it needs
    tok = transformers.AutoTokenizer.from_pretrained(out)
    sample = "return 'héllo' + x"
    assert tok(sample)["input_ids"] == tokenizer.encode(sample)
    assert tok.eos_token_id == tokenizer.eot_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([tokenizer.encode(sample)])
    want = generate(model.eval(), ids, max_new_tokens=5, temperature=0).tokens[0]
    got = hf.generate(ids, do_sample=False, max_new_tokens=5)[0, ids.shape[1] :].tolist()
    assert got == want
    assert main(["export", str(ckpt), "--hf", str(out)]) == 2  # never over an existing folder
    assert "exists" in capsys.readouterr().err
    back = tmp_path / "back"
    assert main(["convert", "--from-hf", str(out), "--out", str(back)]) == 0
    a, b = load_model(ckpt)[0].state_dict(), load_model(back)[0].state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert load_model(back)[1] == cfg
    restored = load_tokenizer(back)
    assert type(restored) is type(tokenizer)
    assert restored.encode(text) == tokenizer.encode(text)


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_exported_and_converted_folders_get_the_modes_of_a_plain_mkdir(tmp_path, mask):
    """`mod export --hf`, `--llama` and `mod convert` write through mkdtemp (0700) and
    safetensors (0600 files): what comes out has the modes a plain mkdir and open give."""
    import os
    import stat

    from mixture_of_depths.cli import main
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    def mode(p):  # noqa: ANN001, ANN202
        return stat.S_IMODE(p.stat().st_mode)

    dense = make_model(tiny_config(vocab_size=257, layer_pattern="D"), dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path / "ck", dense, dense.config, tokenizer=ByteTokenizer())
    old = os.umask(mask)
    try:
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "file").write_text("")
        want = {"dir": mode(tmp_path / "plain"), "file": mode(tmp_path / "plain" / "file")}
        outs = [tmp_path / "hf", tmp_path / "llama", tmp_path / "mod"]
        assert main(["export", str(ckpt), "--hf", str(outs[0])]) == 0
        assert main(["export", str(ckpt), "--llama", str(outs[1])]) == 0
        assert main(["convert", "--from-hf", str(outs[1]), "--out", str(outs[2])]) == 0
    finally:
        os.umask(old)
    for out in outs:
        for p in [out, *out.rglob("*")]:
            assert mode(p) == want["dir" if p.is_dir() else "file"], p


# -- `mod convert` on an exported folder: what it names, and nothing unpickled (issue 35) ---------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):  # noqa: ANN201
    """An exported MoD folder (`mod export --hf`) of a small float32 model."""
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.hf import export_checkpoint
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("exported")
    model = make_model(tiny_config(vocab_size=257), dtype=torch.float32)
    ckpt = save_checkpoint(root / "ck", model, model.config, tokenizer=ByteTokenizer())
    return export_checkpoint(ckpt, root / "hf")


def test_an_exported_folder_with_pickled_weights_is_refused_unread(
    exported, tmp_path, capsys, monkeypatch
):
    """Only pytorch_model.bin (a pickle whose unpickling would write a marker file): refused,
    naming it; neither torch.load nor pickle ever sees it."""
    import pickle
    import shutil
    from pathlib import Path

    from mixture_of_depths.cli import main

    class Boom:
        def __reduce__(self):  # noqa: ANN204
            return (Path.write_text, (marker, "unpickled!"))

    src, marker = tmp_path / "hf", tmp_path / "marker"
    shutil.copytree(exported, src)
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: loads.append(a))
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'pytorch_model.bin'} found: convert it to safetensors first" in err, err
    assert "Traceback" not in err and not loads and not marker.exists()
    assert not (tmp_path / "out").exists()


def _edit_mod(path, **change) -> None:  # noqa: ANN001
    import json

    cfg = json.loads(path.read_text())
    if "mod" in change:
        cfg["mod"] = change["mod"]
    else:
        cfg["mod"].update(change)
    path.write_text(json.dumps(cfg))


EXPORTED_DAMAGE = [  # (file, damage, what the one line must say)
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:100]),
     "model.safetensors: not a readable safetensors file"),
    ("model.safetensors", lambda p: p.write_bytes(b"\x00" * 4), "4 bytes, too short"),
    ("config.json", lambda p: p.write_text("[]"), "expected a JSON object, found list"),
    ("config.json", lambda p: p.write_text('{"mod": {'), "config.json: not valid JSON"),
    ("config.json", lambda p: _edit_mod(p, mod=None), '"mod" must be an object'),
    ("config.json", lambda p: _edit_mod(p, d_model="32"), "config.json: mod: d_model must be"),
    ("config.json", lambda p: _edit_mod(p, n_layers=5),
     "model.safetensors: no tensor 'model.blocks.4.attn_norm.weight', which config.json implies"),
    ("config.json", lambda p: _edit_mod(p, d_ff=64),
     "mlp.w13.weight' has shape [192, 32], config.json implies [128, 32]"),
    ("tokenizer.json", lambda p: p.write_text("\x00 not json"), "tokenizer.json: not a tokenizer"),
]  # fmt: skip


@pytest.mark.parametrize("name,damage,message", EXPORTED_DAMAGE)
def test_a_malformed_exported_folder_is_one_line_naming_the_file(
    exported, tmp_path, capsys, name, damage, message
):
    import shutil

    from mixture_of_depths.cli import main

    src = tmp_path / "hf"
    shutil.copytree(exported, src)
    damage(src / name)
    assert main(["convert", "--from-hf", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(src) in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_generate_on_an_exported_folder_says_to_convert_it(exported, tmp_path, capsys):
    from mixture_of_depths.cli import main

    assert main(["generate", "--checkpoint", str(exported), "--prompt", "def"]) == 2
    err = capsys.readouterr().err
    assert f"{exported} is a Hugging Face folder, not a checkpoint: run `mod convert" in err, err
    assert "import mixture_of_depths.hf" in err
    back = tmp_path / "back"
    assert main(["convert", "--from-hf", str(exported), "--out", str(back)]) == 0
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(back), "--prompt", "def", "--max-new-tokens", "2"]
    assert main(args) == 0
