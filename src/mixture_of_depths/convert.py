"""Pretrained dense Llama-family checkpoints (Hugging Face layout) to MoD models, and our dense
models to that layout.

Supported: ``llama`` and ``mistral`` (``model_type`` in config.json), with SiLU SwiGLU MLPs, no
attention or MLP biases, head_dim = hidden_size / num_attention_heads, default rotary embeddings
(any ``rope_theta``; no ``rope_scaling``), GQA, tied or untied embeddings; Mistral with no sliding
window or one at least as long as the converted model's context. Qwen2 is refused: its q/k/v
projections have biases, which our attention has not. Anything else is refused with the reason.

The mapping is one to one: RMSNorm weights and eps, q/k/v stacked into ``wqkv`` (the same
rotate-half rotary convention, so no permutation), gate and up stacked into ``w13``. The routed
blocks get new routers (and predictors) and the ``straight_through`` gate, exactly 1 in the
forward pass: at capacity 1.0 in top-k routing every token takes every block and the converted
model computes the original's logits. Reading needs only safetensors and JSON (no transformers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .config import MoDConfig
from .data import EOT_TOKEN, BPETokenizer, ByteTokenizer, Tokenizer
from .model import MoDTransformer
from .runtime.checkpoint import save_checkpoint

SUPPORTED = ("llama", "mistral")


class UnsupportedModel(ValueError):
    """A checkpoint this converter cannot map exactly (the message says why)."""


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}: not a Hugging Face model folder")
    return json.loads(path.read_text())


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in (None, "default"):
        raise UnsupportedModel(f"rope type {kind!r}: only default rotary embeddings convert")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def mod_config(
    hf: dict[str, Any],
    layer_pattern: str = "DR",
    capacity: float = 0.125,
    max_seq_len: int | None = None,
    **overrides: Any,
) -> MoDConfig:
    """The MoDConfig of a converted Llama-family config (`hf`: its config.json)."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED:
        why = " (its q/k/v projections have biases)" if kind == "qwen2" else ""
        raise UnsupportedModel(
            f"model_type {kind!r}{why}: only {', '.join(SUPPORTED)} checkpoints convert"
        )
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    checks = {
        "hidden_act": (hf.get("hidden_act", "silu") == "silu", "a SiLU (SwiGLU) MLP"),
        "attention_bias": (not hf.get("attention_bias", False), "no attention biases"),
        "mlp_bias": (not hf.get("mlp_bias", False), "no MLP biases"),
        "head_dim": (hf.get("head_dim") in (None, d // heads), f"head_dim = {d // heads}"),
    }
    for name, (ok, need) in checks.items():
        if not ok:
            raise UnsupportedModel(f"{name}={hf.get(name)!r}: conversion needs {need}")
    context = max_seq_len or hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    if window is not None and window < context:
        raise UnsupportedModel(
            f"sliding_window={window} is shorter than the context {context}: convert with "
            f"--max-seq-len {window} or less (our attention has no sliding window)"
        )
    fields = dict(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, d_ff=hf["intermediate_size"],
        max_seq_len=context, layer_pattern=layer_pattern, capacity=capacity,
        rope_theta=_rope_theta(hf), norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        router_gate="straight_through", init_std=hf.get("initializer_range", 0.02),
        # the routing the conversion study measured (docs/study/round2 trained from scratch)
        causal_router="aux_loss", aux_loss_weight=0.1,
    )  # fmt: skip
    return MoDConfig(**{**fields, **overrides})


def read_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors files (one file, or shards with an index)."""
    d = Path(directory)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {d} (pickled .bin files are not read)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                out[k] = st.get_tensor(k)
    return out


def _layer_map(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        f"blocks.{i}.attn_norm.weight": p + "input_layernorm.weight",
        f"blocks.{i}.attn.wo.weight": p + "self_attn.o_proj.weight",
        f"blocks.{i}.mlp_norm.weight": p + "post_attention_layernorm.weight",
        f"blocks.{i}.mlp.w2.weight": p + "mlp.down_proj.weight",
    }


def from_llama(hf_weights: dict[str, torch.Tensor], cfg: MoDConfig) -> dict[str, torch.Tensor]:
    """Our state dict (routers and predictors aside) from a Llama-family state dict."""
    w = {k.removeprefix("module."): v for k, v in hf_weights.items()}
    out = {"embed.weight": w["model.embed_tokens.weight"], "norm.weight": w["model.norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = w["lm_head.weight"]
    for i in range(cfg.n_layers):
        out.update({ours: w[theirs] for ours, theirs in _layer_map(i).items()})
        p = f"model.layers.{i}."
        out[f"blocks.{i}.attn.wqkv.weight"] = torch.cat(
            [w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]
        )
        out[f"blocks.{i}.mlp.w13.weight"] = torch.cat(
            [w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]
        )
    return out


def to_llama(model: MoDTransformer) -> dict[str, torch.Tensor]:
    """A dense model's weights in the Llama layout (the inverse of `from_llama`)."""
    cfg = model.config
    if any(b.routed for b in model.blocks) or cfg.has_experts:
        raise ValueError("only dense models without experts have a Llama layout")
    sd = model.state_dict()
    hd, H, Hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.n_layers):
        out.update({theirs: sd[ours] for ours, theirs in _layer_map(i).items()})
        p = f"model.layers.{i}."
        q, k, v = sd[f"blocks.{i}.attn.wqkv.weight"].split((H * hd, Hkv * hd, Hkv * hd))
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k})
        out[p + "self_attn.v_proj.weight"] = v
        gate, up = sd[f"blocks.{i}.mlp.w13.weight"].chunk(2)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up})
    return {k: t.contiguous() for k, t in out.items()}


def llama_config(cfg: MoDConfig) -> dict[str, Any]:
    """The config.json of `to_llama`'s weights (transformers' LlamaConfig fields)."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
    }


def convert(
    hf_weights: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    layer_pattern: str = "DR",
    capacity: float = 0.125,
    max_seq_len: int | None = None,
    seed: int = 0,
    **overrides: Any,
) -> MoDTransformer:
    """A MoD model with the dense checkpoint's weights and new routers (and predictors), in the
    checkpoint's dtype."""
    cfg = mod_config(hf_config, layer_pattern, capacity, max_seq_len, **overrides)
    torch.manual_seed(seed)  # the new routers' initialisation
    model = MoDTransformer(cfg)
    weights = from_llama(hf_weights, cfg)
    dtype = weights["embed.weight"].dtype
    model = model.to(dtype)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    new = {k for k in missing if ".router." in k or ".predictor." in k}
    if cfg.tie_embeddings:
        new.add("lm_head.weight")
    if set(missing) - new or unexpected:
        raise UnsupportedModel(
            f"the weights do not map: missing {sorted(set(missing) - new)}, unexpected "
            f"{sorted(unexpected)}"
        )
    return model


# -- tokenizers ----------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what byte-level BPE vocabularies are spelled in)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def _eos_token(directory: Path) -> str:
    """The end-of-text token a folder's tokenizer_config.json names (ours if it names none)."""
    path = directory / "tokenizer_config.json"
    eos = json.loads(path.read_text()).get("eos_token") if path.is_file() else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else EOT_TOKEN


def read_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face folder as ours: the byte tokenizer if it maps text to
    UTF-8 bytes with end-of-text 256 (what `mod export --hf` writes for it), else BPE with the
    folder's end-of-text (eos) token."""
    from tokenizers import Tokenizer as TkTokenizer

    d = Path(directory)
    path = d / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {d}: a converted model needs its (fast) tokenizer"
        )
    tk = TkTokenizer.from_file(str(path))
    sample = "def f(x):\n\treturn 'héllo ☃' + x  # \u00e9\x00"
    if (
        tk.get_vocab_size(with_added_tokens=True) == ByteTokenizer.vocab_size
        and tk.token_to_id(EOT_TOKEN) == ByteTokenizer.eot_id
        and tk.encode(sample, add_special_tokens=False).ids == list(sample.encode("utf-8"))
    ):
        return ByteTokenizer()
    return BPETokenizer(tk, _eos_token(d))


def convert_folder(
    directory: str | Path,
    out: str | Path,
    layer_pattern: str = "DR",
    capacity: float = 0.125,
    max_seq_len: int | None = None,
    seed: int = 0,
    **overrides: Any,
) -> tuple[Path, MoDConfig]:
    """A Llama-family folder (config.json, safetensors weights, tokenizer.json) converted to our
    checkpoint at `out` (which must not hold one)."""
    d, out = Path(directory), Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: pick another")
    hf = read_config(d)
    mod_config(hf, layer_pattern, capacity, max_seq_len, **overrides)  # refuse before reading
    tokenizer = read_tokenizer(d)
    model = convert(read_weights(d), hf, layer_pattern, capacity, max_seq_len, seed, **overrides)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UnsupportedModel(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
            f"{model.config.vocab_size}"
        )
    save_checkpoint(out, model, model.config, tokenizer=tokenizer)
    return out, model.config
