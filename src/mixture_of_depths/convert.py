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

A folder is read for exactly what it names: the tensors its ``model.safetensors.index.json`` maps,
else its one ``model.safetensors``; never a pickle. A damaged or malformed file is a `FolderError`
naming it and what was expected.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from .config import MoDConfig
from .data import EOT_TOKEN, BPETokenizer, ByteTokenizer, Tokenizer
from .model import MoDTransformer
from .runtime.checkpoint import save_checkpoint

SUPPORTED = ("llama", "mistral")


WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


class UnsupportedModel(ValueError):
    """A checkpoint this converter cannot map exactly (the message says why)."""


class FolderError(ValueError):
    """A file of a Hugging Face folder is damaged or not what it should hold (the message names
    the file and what was expected)."""


def bad_file(path: str | Path, reason: str) -> FolderError:
    return FolderError(f"{path}: {reason}")


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file holding an object, or a `FolderError` naming it."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise bad_file(path, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise bad_file(path, f"expected a JSON object, found {type(obj).__name__}")
    return obj


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}: not a Hugging Face model folder")
    return read_json_object(path)


# The config.json fields a conversion reads and the JSON type of each; null is "absent" only for
# those that transformers itself writes as null.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")  # fmt: skip
_OPTIONAL = {
    "num_key_value_heads": int, "max_position_embeddings": int, "head_dim": int,
    "sliding_window": int, "rms_norm_eps": float, "rope_theta": float, "initializer_range": float,
    "tie_word_embeddings": bool, "attention_bias": bool, "mlp_bias": bool, "hidden_act": str,
    "rope_parameters": dict, "rope_scaling": dict,
}  # fmt: skip
_NULLABLE = {"num_key_value_heads", "head_dim", "sliding_window", "rope_parameters", "rope_scaling"}
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          dict: "an object"}  # fmt: skip


def _is(value: Any, kind: type) -> bool:
    if isinstance(value, bool):  # a JSON true is no integer
        return kind is bool
    return isinstance(value, int | float) if kind is float else isinstance(value, kind)


def check_fields(hf: dict[str, Any], where: str | Path = "config.json") -> None:
    """Each field a conversion reads present (if required) and of its JSON type, or a
    `FolderError` naming it: ``config.json: hidden_size must be a positive integer, got "32"``."""
    for name in _REQUIRED:
        value = hf.get(name)
        if value is None:
            raise bad_file(where, f"{name} is missing (a positive integer is expected)")
        if not _is(value, int) or value < 1:
            raise bad_file(where, f"{name} must be a positive integer, got {json.dumps(value)}")
    for name, kind in _OPTIONAL.items():
        if name not in hf or (hf[name] is None and name in _NULLABLE):
            continue
        if not _is(hf[name], kind):
            raise bad_file(where, f"{name} must be {_KINDS[kind]}, got {json.dumps(hf[name])}")
    params = hf.get("rope_parameters") or {}
    if "rope_theta" in params and not _is(params["rope_theta"], float):
        got = json.dumps(params["rope_theta"])
        raise bad_file(where, f"rope_parameters.rope_theta must be a number, got {got}")


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
    check_fields(hf)
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
        # the routing the conversion study measured (experiments/round2 trained from scratch)
        causal_router="aux_loss", aux_loss_weight=0.1,
    )  # fmt: skip
    return MoDConfig(**{**fields, **overrides})


# -- weights: exactly the files a folder names ---------------------------------------------------
@dataclass(frozen=True)
class WeightFiles:
    """The weights a folder names: `source` (its index, or its one model.safetensors) maps each
    tensor to its file (`files`); `shapes` come from the files' headers, all read and checked."""

    source: Path
    files: dict[str, Path]
    shapes: dict[str, tuple[int, ...]]


def _unreadable(path: Path, exc: Exception) -> FolderError:
    size = path.stat().st_size if path.is_file() else 0
    reason = f"{size} bytes, too short for a safetensors header" if size < 8 else str(exc)
    return bad_file(path, f"not a readable safetensors file ({reason or type(exc).__name__})")


def _headers(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape from a safetensors header (no tensor data read)."""
    try:
        with safe_open(path, "pt") as st:
            return {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise _unreadable(path, exc) from None


def _index_map(index: Path) -> dict[str, Path]:
    """The index's weight_map: tensor name -> a .safetensors file of the same folder."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise bad_file(index, 'expected a non-empty "weight_map" object (tensor -> file)')
    out = {}
    for name, file in weight_map.items():
        plain = isinstance(file, str) and Path(file).name == file  # never outside the folder
        if not plain or not file.endswith(".safetensors"):
            what = f"{name!r} maps to {json.dumps(file)}, not a .safetensors file of this folder"
            raise bad_file(index, what)
        out[name] = index.parent / file
    return out


def _no_weights(d: Path) -> FileNotFoundError:
    pickles = sorted(p.name for p in [*d.glob("*.bin"), *d.glob("*.pt"), *d.glob("*.pth")])
    if pickles:
        return FileNotFoundError(
            f"{d / pickles[0]} found: convert it to safetensors first (with transformers, where "
            "you trust the file: from_pretrained, then save_pretrained); pickled weights are "
            f"never read here (no {WEIGHTS} or {INDEX} in {d})"
        )
    return FileNotFoundError(f"no {WEIGHTS} or {INDEX} in {d}: no weights to read")


def find_weights(directory: str | Path) -> WeightFiles:
    """The weights `directory` names: its index's weight_map (every file it names must exist
    and hold the tensors it maps there), else its one model.safetensors. Other ``*.safetensors``
    files are not read (a note on stderr names each); a pickled ``.bin`` never is."""
    d = Path(directory)
    index = d / INDEX
    if index.is_file():
        source, files = index, _index_map(index)
        shapes: dict[str, tuple[int, ...]] = {}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise bad_file(index, f"it names {file.name}, which is not in {d}")
            header = _headers(file)
            names = [n for n, f in files.items() if f == file]
            lost = [n for n in names if n not in header]
            if lost:
                raise bad_file(file, f"it holds no tensor {lost[0]!r}, which {INDEX} maps to it")
            shapes.update({n: header[n] for n in names})
    elif (d / WEIGHTS).is_file():
        source = d / WEIGHTS
        shapes = _headers(source)
        files = dict.fromkeys(shapes, source)
    else:
        raise _no_weights(d)
    for other in sorted(set(d.glob("*.safetensors")) - set(files.values())):
        print(f"note: {other} is not read: {source.name} does not name it", file=sys.stderr)
    return WeightFiles(source, files, shapes)


def read_weights(directory: str | Path | WeightFiles) -> dict[str, torch.Tensor]:
    """The tensors a folder names (`find_weights`), each read from its own file."""
    weights = directory if isinstance(directory, WeightFiles) else find_weights(directory)
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(weights.files.values())):
        names = [n for n, f in weights.files.items() if f == file]
        try:
            with safe_open(file, "pt") as st:
                out.update({n: st.get_tensor(n) for n in names})
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise _unreadable(file, exc) from None
    return out


def _layer_map(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        f"blocks.{i}.attn_norm.weight": p + "input_layernorm.weight",
        f"blocks.{i}.attn.wo.weight": p + "self_attn.o_proj.weight",
        f"blocks.{i}.mlp_norm.weight": p + "post_attention_layernorm.weight",
        f"blocks.{i}.mlp.w2.weight": p + "mlp.down_proj.weight",
    }


def llama_shapes(cfg: MoDConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family state dict of `cfg` holds (what `from_llama` reads), with
    its shape."""
    d, V, f = cfg.d_model, cfg.vocab_size, cfg.d_ff
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (V, d)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        out.update(
            {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
        )
        out.update({p + "self_attn.q_proj.weight": (q, d), p + "self_attn.o_proj.weight": (d, q)})
        out.update({p + "self_attn.k_proj.weight": (kv, d), p + "self_attn.v_proj.weight": (kv, d)})
        out.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d)})
        out[p + "mlp.down_proj.weight"] = (d, f)
    return out


def check_weights(weights: WeightFiles, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor of `shapes` (what config.json implies) is in the folder, at its shape, or a
    `FolderError` naming the file that should hold it."""
    have = {n.removeprefix("module."): n for n in weights.files}  # as DDP's wrapper saved them
    for name, shape in shapes.items():
        if name not in have:
            raise bad_file(weights.source, f"no tensor {name!r}, which config.json implies")
        got = weights.shapes[have[name]]
        if got != shape:
            raise bad_file(
                weights.files[have[name]],
                f"{name!r} has shape {list(got)}, config.json implies {list(shape)}",
            )


def from_llama(hf_weights: dict[str, torch.Tensor], cfg: MoDConfig) -> dict[str, torch.Tensor]:
    """Our state dict (routers and predictors aside) from a Llama-family state dict."""
    w = {k.removeprefix("module."): v for k, v in hf_weights.items()}
    missing = [n for n in llama_shapes(cfg) if n not in w]
    if missing:
        raise UnsupportedModel(f"the weights have no {missing[0]!r} ({len(missing)} missing)")
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
    eos = read_json_object(path).get("eos_token") if path.is_file() else None
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
    try:
        tk = TkTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own plain Exception
        raise bad_file(path, f"not a tokenizer the tokenizers library reads ({exc})") from None
    sample = "def f(x):\n\treturn 'héllo ☃' + x  # \u00e9\x00"
    if (
        tk.get_vocab_size(with_added_tokens=True) == ByteTokenizer.vocab_size
        and tk.token_to_id(EOT_TOKEN) == ByteTokenizer.eot_id
        and tk.encode(sample, add_special_tokens=False).ids == list(sample.encode("utf-8"))
    ):
        return ByteTokenizer()
    try:
        return BPETokenizer(tk, _eos_token(d))
    except FolderError:
        raise
    except ValueError as exc:  # its end-of-text token is not in the vocabulary
        raise bad_file(path, str(exc)) from None


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
    if hf.get("model_type") in SUPPORTED:  # field errors then name this folder's config.json
        check_fields(hf, d / "config.json")
    cfg = mod_config(hf, layer_pattern, capacity, max_seq_len, **overrides)  # refuse early
    tokenizer = read_tokenizer(d)
    weights = find_weights(d)
    check_weights(weights, llama_shapes(cfg))  # before any tensor is read
    model = convert(
        read_weights(weights), hf, layer_pattern, capacity, max_seq_len, seed, **overrides
    )
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UnsupportedModel(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
            f"{model.config.vocab_size}"
        )
    save_checkpoint(out, model, model.config, tokenizer=tokenizer)
    return out, model.config
