"""A Mixture-of-Depths model's forward pass: training's top-k routing, causal routing, and how
well the causal decision imitates top-k. Runs in a second on a CPU: ``python
examples/forward_and_routing.py``. Each ``# -> ...`` comment is what the line prints (checked
by tests/test_examples.py; ``~`` means within 5%)."""

import math

import torch

from mixture_of_depths import MoDConfig, MoDTransformer, routing_scores

torch.manual_seed(0)
cfg = MoDConfig.preset("small")  # 8 layers, every other block routed at capacity 0.125
model = MoDTransformer(cfg)  # a new model is in training mode
idx = torch.randint(0, cfg.vocab_size, (4, 257))

# forward does not shift its targets: y[:, t] is the token position t predicts
x, y = idx[:, :-1], idx[:, 1:]
out = model(x, targets=y, routing="topk")
# an untrained model guesses: its loss is about ln(vocab)
print(f"{out.lm_loss:.2f} vs ln(vocab) {math.log(cfg.vocab_size):.2f}")  # -> ~5.6 vs ln(vocab) 5.55
# targets=x asks each position for itself: a copy task, far below ln(vocab) from the start
print(f"{model(x, targets=x, routing='topk').lm_loss:.1f}")  # -> ~2.6

# top-k: each routed block takes exactly k = floor(0.125 * 256) = 32 tokens of every row
for r in out.routes:  # one record per router, in layer order
    print(r.name, r.mask.sum(1).tolist())  # -> ... [32, 32, 32, 32]

# causal: each token decides alone (an untrained predictor: far more or fewer than 32)
causal = model(x, routing="causal")
print(len(causal.routes), causal.routes[0].mask.shape)  # -> 4 torch.Size([4, 256])

# the causal decision against top-k, on the top-k forward: recall and precision of the top-k
# set say whether it imitates top-k; the paper's accuracy rewards a router that never fires
scores = routing_scores(out.routes)
print(*scores["1"])  # -> recall precision balanced_accuracy take_rate accuracy

# a call without routing follows the mode: top-k in training mode, causal in eval mode
model.eval()
plain = model(x, targets=y)
print(torch.equal(plain.logits, model(x, targets=y, routing="causal").logits))  # -> True
