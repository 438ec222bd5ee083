"""lm-eval's `HFLM` scores loglikelihoods with our model object (`pip install lm-eval
accelerate`; skipped without them). Oracle: the same sums computed directly from our model's
causal-routing logits. No dataset is downloaded: the requests are built here."""

from __future__ import annotations

import pytest
import torch
from helpers import make_model, tiny_config

pytest.importorskip("transformers", minversion="5")

pytestmark = pytest.mark.hf
pytest.importorskip("accelerate")
lm_eval_hf = pytest.importorskip("lm_eval.models.huggingface")

from lm_eval.api.instance import Instance  # noqa: E402

from mixture_of_depths.data import ByteTokenizer  # noqa: E402
from mixture_of_depths.hf import MoDForCausalLM, hf_tokenizer  # noqa: E402


def test_hflm_loglikelihoods_equal_our_model():
    tok = ByteTokenizer()
    model = make_model(tiny_config(vocab_size=tok.vocab_size), dtype=torch.float32).eval()
    hf = MoDForCausalLM.from_mod(model, eos_token_id=tok.eot_id, pad_token_id=tok.eot_id)
    lm = lm_eval_hf.HFLM(
        pretrained=hf, tokenizer=hf_tokenizer(tok), backend="causal", device="cpu", batch_size=2
    )
    requests = [("def f(x):", " return x"), ("import os", "\nimport sys"), ("a = 1", " + 2")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(requests)])
    for (context, cont), (ll, _greedy) in zip(requests, got, strict=True):
        ids = torch.tensor([tok.encode(context + cont)])
        n = len(tok.encode(cont))
        with torch.no_grad():
            logp = model(ids, routing="causal").logits.log_softmax(-1)[0]
        T = ids.shape[1]
        want = sum(logp[t - 1, ids[0, t]].item() for t in range(T - n, T))
        assert ll == pytest.approx(want, rel=1e-5)
