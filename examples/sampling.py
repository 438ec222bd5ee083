"""Sampling and a decode loop of your own, with the KV cache that stores in each routed layer
only the tokens that took it. ``python examples/sampling.py``; each ``# -> ...`` comment is what
the line prints (checked by tests/test_examples.py)."""

import torch

from mixture_of_depths import KVCache, MoDConfig, MoDTransformer, generate

torch.manual_seed(0)
cfg = MoDConfig.preset("tiny")  # 4 layers, blocks 1 and 3 routed
model = MoDTransformer(cfg).eval()

# prompts of different lengths; routing is causal (no token reads the future)
res = generate(model, [[72, 101, 108], [100, 101, 102, 32]], max_new_tokens=16,
               temperature=0.8, top_p=0.95, seed=0, return_routing=True)  # fmt: skip
print([len(t) for t in res.tokens])  # -> [16, 16]
# per row: (prompt + new tokens, routers) bool, which routed blocks each token took
print(tuple(res.routing[0].shape))  # -> (19, 2)

# the same forward runs a prefill (empty cache, right-padded prompts) and decode steps
prompts = torch.tensor([[72, 101, 108, 0], [100, 101, 102, 32]])  # row 0 is padded
cache = KVCache(cfg, batch_size=2, max_len=64)
with torch.no_grad():
    out = model(prompts, routing="causal", cache=cache, lengths=torch.tensor([3, 4]),
                last_only=True)  # fmt: skip
    for _ in range(8):
        next_ids = out.logits[:, -1].argmax(-1)
        out = model(next_ids[:, None], routing="causal", cache=cache)
# (layers, rows): dense layer 0 holds every token of each row (3 + 8, 4 + 8)
print(tuple(cache.lengths.shape), cache.lengths[0].tolist())  # -> (4, 2) [11, 12]
# a routed layer holds only the tokens that took it: at most as many
print(bool((cache.lengths[1] <= cache.lengths[0]).all()))  # -> True
