"""MoD models as Hugging Face `transformers` models (the optional extra ``[hf]``).

`MoDForCausalLM` wraps a `MoDTransformer`: ``AutoModelForCausalLM.from_pretrained`` loads it,
``save_pretrained`` writes it (safetensors), and ``generate`` samples from it through transformers
(greedy, sampling, ``max_new_tokens``, ``eos_token_id``, left-padded batches with an attention
mask) with our KV cache, whose routed layers hold only the tokens that took them.

How generation fits transformers (docs/huggingface.md):

- The cache is `MoDCache`, a transformers `Cache` around our `KVCache`. transformers asks a cache
  how many positions it has seen (``get_seq_length``) to slice the next inputs; a routed layer
  holds fewer keys than that, so the count is kept apart from the keys: positions processed, in
  transformers' layout (left padding included).
- transformers pads batches on the left; our cache and rotary positions are per row, so a prefill
  moves each row's tokens to the left edge (right padding, each row's own positions from 0) and
  maps the logits back. Every row then computes exactly what it computes alone, and greedy output
  equals `mixture_of_depths.generate` token for token.
- Routing is causal in evaluation and generation (the decisions decoding can make) and top-k in
  training mode, as in our own trainer; ``config.prefill_routing = "topk"`` routes prompts with
  the paper's top-k instead.
- Beam search and assisted decoding (which reorder or crop a cache) are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

try:
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        GenerationMixin,
        PreTrainedConfig,
        PreTrainedModel,
    )
    from transformers.cache_utils import Cache as HFCache
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "mixture_of_depths.hf needs Hugging Face transformers 5: pip install "
        "'mixture-of-depths[hf]'"
    ) from exc

import json
import shutil
from pathlib import Path

from .cache import KVCache
from .config import MoDConfig
from .convert import (
    bad_file,
    bytes_to_unicode,
    check_weights,
    find_weights,
    llama_config,
    read_config,
    read_tokenizer,
    read_weights,
    to_llama,
)
from .data import EOT_TOKEN, BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer
from .fileio import empty_folder, place_folder, plain_modes, staging
from .generate import decode_step
from .model import IGNORE_INDEX, MoDTransformer
from .runtime.checkpoint import load_model, resolve_checkpoint, save_checkpoint

MODEL_TYPE = "mixture_of_depths"
PREFILL_ROUTINGS = ("causal", "topk")
# transformers' standard names for what MoDConfig calls otherwise (tools such as lm-eval read them).
_STANDARD_NAMES = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "num_key_value_heads": "n_kv_heads",
    "max_position_embeddings": "max_seq_len",
    "rope_theta": "rope_theta",
}


class MoDHFConfig(PreTrainedConfig):
    """A `MoDConfig` (under ``mod``) as a transformers config, with the standard names beside it
    (``hidden_size``, ``num_hidden_layers``...: read-only copies)."""

    model_type = MODEL_TYPE

    def __init__(
        self,
        mod: dict[str, Any] | None = None,
        prefill_routing: str = "causal",
        **kwargs: Any,
    ) -> None:
        cfg = MoDConfig.from_dict(mod) if mod else MoDConfig()
        if prefill_routing not in PREFILL_ROUTINGS:
            raise ValueError(
                f"prefill_routing must be one of {PREFILL_ROUTINGS}, got {prefill_routing!r}"
            )
        self.mod = cfg.to_dict()
        self.prefill_routing = prefill_routing
        for name, field in _STANDARD_NAMES.items():
            kwargs.pop(name, None)  # derived from `mod`, never set apart from it
            setattr(self, name, getattr(cfg, field))
        kwargs["tie_word_embeddings"] = cfg.tie_embeddings
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)

    @property
    def mod_config(self) -> MoDConfig:
        return MoDConfig.from_dict(self.mod)


class MoDCache(HFCache):
    """transformers' handle on our `KVCache` (made by the first forward, the prefill).

    `get_seq_length` is the number of positions processed in transformers' layout (the width of
    the attention mask so far, left padding included), not the keys a layer holds: a routed
    layer's count falls behind. `kv` is the cache our model reads and writes; `pad` the left
    padding of each row.
    """

    def __init__(self, max_len: int | None = None) -> None:
        super().__init__(layers=[])
        self.max_len = max_len
        self.kv: KVCache | None = None
        self.pad: Tensor | None = None
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        return [False]

    @property
    def is_croppable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: Tensor) -> None:
        raise NotImplementedError("MoD models do not support beam search: use greedy or sampling")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(
            "a MoD cache cannot be cropped (assisted decoding is not supported)"
        )

    def __repr__(self) -> str:
        return f"MoDCache(seen={self.seen}, kv={'empty' if self.kv is None else 'filled'})"


def _rows(attention_mask: Tensor | None, B: int, T: int, device: torch.device) -> Tensor:
    """(B,) left padding of each row from a 2-D mask of ones after zeros, or a clear error."""
    if attention_mask is None:
        return torch.zeros(B, dtype=torch.long, device=device)
    m = attention_mask
    if m.shape != (B, T):
        raise ValueError(
            f"attention_mask must be (batch, seq_len) = ({B}, {T}), got {tuple(m.shape)}"
        )
    m = m.to(torch.long)
    lens = m.sum(1)
    pad = T - lens
    expected = torch.arange(T, device=m.device)[None, :] >= pad[:, None]
    if not torch.equal(m.bool(), expected) or int(lens.min()) < 1:
        raise ValueError(
            "attention_mask must be left-padded rows (zeros, then at least one one): a MoD "
            "model reads each row's tokens from its first real one"
        )
    return pad


def _left_to_right(ids: Tensor, pad: Tensor) -> Tensor:
    """Rows of left-padded `ids` moved to the left edge (right padding, the pad slots copy the
    row's first token: they are never read)."""
    T = ids.shape[1]
    src = (torch.arange(T, device=ids.device)[None, :] + pad[:, None]).clamp(max=T - 1)
    return ids.gather(1, src)


class MoDForCausalLM(PreTrainedModel, GenerationMixin):
    """A MoD language model with transformers' API (see the module docstring)."""

    config_class = MoDHFConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["DenseBlock", "RoutedBlock"]

    def __init__(self, config: MoDHFConfig, model: MoDTransformer | None = None) -> None:
        super().__init__(config)
        self.model = model if model is not None else MoDTransformer(config.mod_config)
        if config.mod_config.tie_embeddings:
            self._tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """Nothing: `MoDTransformer` initialises its own weights (scaled residual projections)."""

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.model.lm_head

    @classmethod
    def from_mod(cls, model: MoDTransformer, **config_kwargs: Any) -> MoDForCausalLM:
        """Wrap a trained `MoDTransformer` (its weights shared, not copied)."""
        config = MoDHFConfig(mod=model.config.to_dict(), **config_kwargs)
        hf = cls(config, model=model).to(next(model.parameters()).dtype)
        return hf.train(model.training)

    # -- generation -------------------------------------------------------------------------------
    def _prepare_cache_for_generation(
        self, generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any
    ) -> None:
        given = model_kwargs.get("cache")
        if getattr(generation_config, "num_beams", 1) > 1:
            raise ValueError("MoD models do not support beam search (num_beams > 1)")
        if given is not None:
            if not isinstance(given, MoDCache):
                raise ValueError(f"a MoD model needs a MoDCache, got {type(given).__name__}")
            return
        if generation_config.use_cache is False:
            return
        # transformers' max_cache_length: prompt width plus max_new_tokens. Sizing the cache by
        # it keeps a long-context model's dense layers from allocating max_seq_len slots.
        max_len = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
        model_kwargs["cache"] = MoDCache(max_len if isinstance(max_len, int) else None)

    # -- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: MoDCache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """Logits (and the loss, with `labels`: the mean next-token cross-entropy over labels
        that are not -100, plus the router and expert auxiliary losses in training mode).

        `position_ids` are ignored: each row's positions count from its first real token.
        `logits_to_keep=1`: logits of the last position only."""
        if inputs_embeds is not None or input_ids is None:
            raise ValueError("MoD models take input_ids (inputs_embeds is not supported)")
        B, T = input_ids.shape
        if cache is None and use_cache and not self.training:
            cache = MoDCache()
        if cache is not None:
            if not isinstance(cache, MoDCache):
                raise ValueError(f"a MoD model needs a MoDCache, got {type(cache).__name__}")
            if labels is not None:
                raise ValueError("labels with a cache: a cached forward computes no loss")
            logits = self._cached(input_ids, attention_mask, cache, logits_to_keep == 1)
            return CausalLMOutputWithPast(logits=logits, cache=cache)
        pad = _rows(attention_mask, B, T, input_ids.device)
        targets = None
        if labels is not None:
            if labels.shape != (B, T):
                raise ValueError(
                    f"labels must be (batch, seq_len) = ({B}, {T}), got {tuple(labels.shape)}"
                )
            targets = torch.full_like(labels, IGNORE_INDEX)
            targets[:, :-1] = labels[:, 1:]  # transformers' labels are the inputs: shift here
        if int(pad.max()) == 0:
            routing = "topk" if self.training else "causal"
            out = self.model(input_ids, targets=targets, routing=routing)
            loss = None
            if targets is not None:
                loss = out.loss if self.training else out.lm_loss
            logits = out.logits[:, -1:] if logits_to_keep == 1 else out.logits
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        if self.training or targets is not None:
            raise ValueError(
                "padded batches (an attention_mask with zeros) are for evaluation and generation: "
                "train on unpadded rows (mark unwanted tokens with labels -100)"
            )
        # Each row on its own positions: a throwaway cache's prefill runs right-padded rows.
        logits = self._cached(input_ids, attention_mask, MoDCache(), logits_to_keep == 1)
        return CausalLMOutputWithPast(logits=logits)

    @torch.no_grad()
    def _cached(
        self, input_ids: Tensor, attention_mask: Tensor | None, cache: MoDCache, last: bool
    ) -> Tensor:
        """A prefill (empty cache) or decode steps (one per new token) on our KV cache, logits
        in transformers' left-padded layout."""
        B, T = input_ids.shape
        if cache.kv is None:
            mask = None if attention_mask is None else attention_mask[:, -T:]
            pad = _rows(mask, B, T, input_ids.device)
            lens = (T - pad).cpu()
            cfg = self.model.config
            room = cfg.max_seq_len if cache.max_len is None else min(cache.max_len, cfg.max_seq_len)
            param = next(self.model.parameters())
            cache.kv = KVCache(cfg, B, max(room, int(lens.max())), param.device, param.dtype)
            cache.pad = pad
            routing = self.config.prefill_routing
            idx = _left_to_right(input_ids, pad)
            out = self.model(idx, routing=routing, cache=cache.kv, lengths=lens, last_only=last)
            cache.seen = T
            if last:
                return out.logits
            # Back to the left-padded layout; padding positions get zeros (never read).
            pos = torch.arange(T, device=idx.device)[None, :]
            src = (pos - pad[:, None]).clamp(min=0)
            logits = out.logits.gather(1, src[..., None].expand(-1, -1, out.logits.shape[-1]))
            return logits.masked_fill((pos < pad[:, None])[..., None], 0.0)
        if cache.kv.batch_size != B:
            raise ValueError(f"the cache holds {cache.kv.batch_size} rows, input_ids has {B}")
        steps = []
        for t in range(T):  # each new token a decode step: what it would see generated one by one
            steps.append(decode_step(self.model, input_ids[:, t], cache.kv)[0])
            cache.seen += 1
        logits = torch.stack(steps, 1)
        return logits[:, -1:] if last else logits


# -- tokenizers and whole folders ----------------------------------------------------------------
def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """Our tokenizer as a transformers `PreTrainedTokenizerFast` with the same ids: a BPE one as
    it is; the byte tokenizer as byte-level BPE with no merges (byte b is id b, end-of-text 256)."""
    from tokenizers import Tokenizer as TkTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, BPETokenizer):
        tk = TkTokenizer.from_str(tokenizer._json)
    elif isinstance(tokenizer, ByteTokenizer):
        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        vocab[EOT_TOKEN] = tokenizer.eot_id
        tk = TkTokenizer(models.BPE(vocab=vocab, merges=[]))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([EOT_TOKEN])
    else:
        raise ValueError(f"no transformers tokenizer for {type(tokenizer).__name__}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token=EOT_TOKEN, pad_token=EOT_TOKEN, bos_token=None
    )


def _write_folder(out: str | Path, write: Any) -> Path:
    """`write(tmp)` into a temporary folder, then placed as `out` (which must not exist, or be
    empty: it is then filled, keeping its mode and links): a folder complete or absent."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or not empty_folder(out)):
        raise FileExistsError(f"{out} exists and is not an empty folder: pick another")
    place, tmp = staging(out)
    try:
        write(tmp)
        plain_modes(tmp)  # not mkdtemp's 0700 (nor 0600 files): what a plain mkdir would give
        place_folder(tmp, place)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_checkpoint(checkpoint: str | Path, out: str | Path) -> Path:
    """Our checkpoint as a transformers folder: config.json, model.safetensors,
    generation_config.json and the tokenizer (`AutoModelForCausalLM` and `AutoTokenizer` load it
    once `mixture_of_depths.hf` is imported)."""
    ckpt = resolve_checkpoint(checkpoint)
    model, _ = load_model(ckpt)
    tokenizer = load_tokenizer(ckpt)
    eot = tokenizer.eot_id
    hf = MoDForCausalLM.from_mod(model.eval(), eos_token_id=eot, pad_token_id=eot)
    hf.generation_config.eos_token_id = eot
    hf.generation_config.pad_token_id = eot

    def write(tmp: Path) -> None:
        hf.save_pretrained(tmp)
        hf_tokenizer(tokenizer).save_pretrained(tmp)
        (tmp / "README.md").write_text(EXPORT_README)

    return _write_folder(out, write)


# What an exported folder says about itself: transformers does not know the model type until
# our module registers it (without it, transformers suggests upgrading transformers).
EXPORT_README = """# A Mixture-of-Depths model (mixture-of-depths)

Written by `mod export`. transformers loads it once `mixture_of_depths.hf` is imported, which
registers the model type `mixture_of_depths` (without the import transformers does not know
the type and suggests upgrading itself):

```python
import mixture_of_depths.hf  # noqa: F401  (registers the model type)
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("this/folder")  # routes causally in eval mode
tokenizer = AutoTokenizer.from_pretrained("this/folder")
```

Install the package with its `hf` extra (from its repository: `pip install -e '.[hf]'`).
A dense model exports to a plain Llama folder instead: `mod export CKPT --llama OUT`.
"""


def export_llama(checkpoint: str | Path, out: str | Path) -> Path:
    """A dense checkpoint of ours as a transformers Llama folder (`LlamaForCausalLM` loads it,
    no import of ours needed), with its tokenizer."""
    from safetensors.torch import save_file

    ckpt = resolve_checkpoint(checkpoint)
    model, cfg = load_model(ckpt)
    weights = to_llama(model)
    tokenizer = load_tokenizer(ckpt)
    config = {
        **llama_config(cfg),
        "torch_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "eos_token_id": tokenizer.eot_id,
        "pad_token_id": tokenizer.eot_id,
    }

    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, tmp / "model.safetensors", {"format": "pt"})
        hf_tokenizer(tokenizer).save_pretrained(tmp)

    return _write_folder(out, write)


def _exported_config(directory: Path) -> MoDConfig:
    """The `MoDConfig` an exported folder's config.json holds under ``mod``, or an error naming
    the file."""
    path = directory / "config.json"
    hf = read_config(directory)
    if hf.get("model_type") != MODEL_TYPE:
        kind = hf.get("model_type")
        raise ValueError(f"{directory} holds a {kind!r} model, not a {MODEL_TYPE!r} one")
    mod = hf.get("mod")
    if not isinstance(mod, dict):
        got = json.dumps(mod)
        raise bad_file(path, f'"mod" must be an object (the MoDConfig of the model), got {got}')
    try:
        return MoDConfig.from_dict(mod)
    except (ValueError, TypeError) as exc:
        raise bad_file(path, f"mod: {exc}") from None


def import_pretrained(directory: str | Path, out: str | Path) -> Path:
    """A transformers folder of a MoD model (`export_checkpoint`'s) as our checkpoint.

    The weights are read as `mixture_of_depths.convert` reads any folder: exactly the
    safetensors files it names, each tensor checked against config.json before any is read;
    a pickled ``pytorch_model.bin`` is refused, never loaded (transformers would unpickle it)."""
    d, out = Path(directory), Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty: pick another")
    cfg = _exported_config(d)
    weights = find_weights(d)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        want = {f"model.{k}": tuple(t.shape) for k, t in MoDTransformer(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        want.pop("model.lm_head.weight")  # stored once, as the embedding
    check_weights(weights, want)
    extra = sorted(set(weights.files) - set(want))
    if extra:
        raise bad_file(weights.source, f"tensor {extra[0]!r} is not in the model config.json names")
    tensors = read_weights(weights)
    model = MoDTransformer(cfg).to(tensors["model.embed.weight"].dtype)
    model.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items()}, strict=False)
    tokenizer = read_tokenizer(d)
    return save_checkpoint(out, model, cfg, tokenizer=tokenizer)


AutoConfig.register(MODEL_TYPE, MoDHFConfig)
AutoModelForCausalLM.register(MoDHFConfig, MoDForCausalLM)
