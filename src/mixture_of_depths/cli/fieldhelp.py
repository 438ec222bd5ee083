"""One line of help per config field, for the flags `add_dataclass_flags` makes: what the value
means, in the words of docs/semantics.md, docs/mor.md and docs/mode.md (the defaults are added
where the flag is made). Every field of `MoDConfig` and `TrainConfig` has one (a test checks)."""

from __future__ import annotations

MODEL_HELP: dict[str, str] = {
    "vocab_size": "tokens in the vocabulary (a new run sets it from its tokenizer)",
    "d_model": "width of the residual stream",
    "n_layers": "blocks (a recursive model: unique layers)",
    "n_heads": "attention heads",
    "n_kv_heads": "key/value heads (fewer than --n-heads: grouped-query attention)",
    "d_ff": "MLP hidden width (unset: --ff-mult x d_model, rounded up to a multiple of 32)",
    "ff_mult": "MLP hidden width as a multiple of d_model when --d-ff is unset",
    "max_seq_len": "longest context the model takes",
    "layer_pattern": "block kinds, repeated over the layers: D dense, R routed (e.g. DR)",
    "capacity": "share of each sequence's tokens a routed block processes (top-k), in (0, 1]",
    "routing": "what a routed layer routes: joint (the whole block), staggered (attention and "
    "MLP apart), mlp (only the MLP; attention dense for every token), mlp_kv (every token "
    "queries; only the takers are keys and values and take the MLP)",
    "router_gate": "how the router weight scales a chosen token's update",
    "causal_router": "the causal decision used for sampling: a small predictor, or the "
    "router's own logit trained by an auxiliary loss",
    "router_scores": "learned routers, or random scores (the baseline for learned routing)",
    "random_take_rates": "with random scores: causal take-rate per router, comma-separated "
    "(empty: the capacity)",
    "causal_thresholds": "per router, the score a causal decision must exceed (mod calibrate "
    "fits them; empty: 0)",
    "aux_loss_weight": "weight of the causal router's loss (the predictor's or the router's "
    "BCE; token-choice recursion: the depth-balancing loss)",
    "predictor_hidden": "hidden width of the causal predictor",
    "skipped_kv": "keys and values in a routed layer: none (only the tokens that took it), "
    "residual (every token's, from the layer's input)",
    "tie_embeddings": "share the input embedding with the output head",
    "rope_theta": "rotary position embedding base",
    "norm_eps": "RMSNorm epsilon",
    "init_std": "standard deviation of the weight initialisation",
    "n_experts": "experts per MLP (0: the plain SwiGLU MLP)",
    "experts_per_token": "experts each token takes (top-k over real and no-op experts)",
    "d_ff_expert": "hidden width of one expert (unset: d_ff / experts_per_token)",
    "n_noop_experts": "no-op experts, which add exactly zero (integrated MoDE)",
    "expert_capacity_factor": "tokens an expert takes as a multiple of an even share (unset: "
    "no dropping)",
    "moe_balance_loss_weight": "weight of the experts' load-balancing loss",
    "moe_z_loss_weight": "weight of the experts' router z-loss",
    "recursions": "passes over the shared layers, N_r (1: no recursion; docs/mor.md)",
    "recursion_sharing": "which layers are shared: middle_cycle (all but the first and last) "
    "or cycle (all)",
    "recursion_capacities": "expert choice: share of the tokens per recursion step, "
    "non-increasing, the first 1 (e.g. 1,0.5,0.25; the routed steps' alone, 0.5,0.25, mean the "
    "same; unset: 1, 1/2, 1/4, ...)",
    "recursion_router": "expert (each step keeps the top share of the tokens still active) or "
    "token (one router gives each token its number of passes)",
    "recursion_kv": "a later step's attention: recursion (among its own tokens, caching theirs) "
    "or share (reads the first pass's keys and values)",
}

TRAIN_HELP: dict[str, str] = {
    "out": "the run folder to write: OUT/checkpoint (what mod eval, generate, serve and "
    "calibrate read; they also take OUT itself), metrics.jsonl, run.json, summary.json",
    "data": "a text file or folder to train on (unset: the embedded default corpus)",
    "tokenizer": "byte-level, or BPE trained on the training split and saved with the model",
    "bpe_vocab_size": "vocabulary of the BPE tokenizer",
    "batch_size": "sequences per step",
    "seq_len": "tokens per sequence (unset: the model's max_seq_len)",
    "steps": "optimizer steps",
    "lr": "peak learning rate (AdamW, cosine decay)",
    "min_lr_ratio": "final learning rate as a share of the peak",
    "warmup_steps": "steps of linear learning-rate warm-up",
    "weight_decay": "AdamW weight decay",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "clip the gradient norm to this (0: no clipping)",
    "eval_every": "steps between evaluations (each writes a checkpoint)",
    "checkpoint_every": "steps between checkpoints without an evaluation (0: only with them)",
    "eval_batches": "validation batches per evaluation",
    "log_every": "steps between training-loss log lines",
    "seed": "seed of the weights and the data order",
    "device": "auto (cuda if available, else cpu), cpu, cuda, cuda:N",
    "compile": "torch.compile the training step",
    "grad_accum": "micro-batches per step: the same step in less memory",
    "parallel": "under torchrun: ddp, fsdp (FSDP2 shards), or auto",
    "dtype": "parameters and compute (float64 for exactness checks)",
    "checkpoint_format": "whole (one safetensors file), sharded (one per rank), or auto",
    "init_from": "start from this checkpoint's weights, config and tokenizer (fine-tuning)",
    "tune": "what fine-tuning trains: all parameters, or only the routers and predictors",
    "distill": "weight of KL(frozen dense teacher || model) when fine-tuning",
    "capacity_warmup": "steps over which capacity falls from 1 to the model's (0: by ratio)",
    "capacity_warmup_ratio": "share of the steps over which capacity falls from 1 (0: none)",
    "calibrate": "at the end, fit the causal thresholds to the capacity on held-out windows",
}
