"""Batches of a token stream: training windows a pure function of (seed, step), so a resumed
run reads the same tokens, and fixed validation batches."""

from __future__ import annotations

from typing import Any

import torch


def _check_stream(tokens: torch.Tensor, batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    if tokens.dim() != 1:
        raise ValueError(f"token stream must be 1-D, got shape {tuple(tokens.shape)}")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"token stream has {len(tokens)} tokens, fewer than seq_len + 1 = {seq_len + 1}"
        )


def _windows(
    tokens: torch.Tensor, starts: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.empty(len(starts), seq_len, dtype=torch.int64)
    y = torch.empty(len(starts), seq_len, dtype=torch.int64)
    # Row-by-row copies stay below torch's parallel grain size: one batched gather + cast spun
    # up OpenMP and was 10-50x slower on a busy 2-core machine.
    for row, s in enumerate(starts.tolist()):
        x[row].copy_(tokens[s : s + seq_len])
        y[row].copy_(tokens[s + 1 : s + seq_len + 1])
    return x, y


class BatchSampler:
    """Random (x, y) windows from a token stream; batch ``i`` depends only on (seed, i).

    That makes resuming exact: restore :meth:`state_dict` and the same batches follow, with
    no generator state to save.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0) -> None:
        _check_stream(tokens, batch_size, seq_len)
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.step = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return int64 ``(x, y)`` of shape (batch_size, seq_len), y = x shifted by one."""
        g = torch.Generator()
        # Mask into the generator's seed range so any int seed/step is accepted.
        g.manual_seed((self.seed * 1_000_003 + self.step) & 0xFFFF_FFFF_FFFF_FFFF)
        high = len(self.tokens) - self.seq_len  # last valid start is len - seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=g)
        self.step += 1
        return _windows(self.tokens, starts, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {
            "seed": self.seed,
            "step": self.step,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("batch_size", "seq_len"):
            if name in state and int(state[name]) != getattr(self, name):
                raise ValueError(
                    f"sampler state has {name}={state[name]}, but this sampler uses "
                    f"{getattr(self, name)}; resume with the same {name}"
                )
        self.seed = int(state["seed"])
        self.step = int(state["step"])


def eval_batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, n_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic evaluation batches of windows spread evenly over the whole stream.

    Windows never share a target token. A short stream gives fewer batches; one with at least
    seq_len + 1 tokens but room for fewer than ``batch_size`` windows gives one smaller batch.
    """
    _check_stream(tokens, batch_size, seq_len)
    if n_batches < 1:
        raise ValueError(f"n_batches must be >= 1, got {n_batches}")
    room = (len(tokens) - 1) // seq_len  # windows with disjoint targets that fit
    wanted = min(batch_size * n_batches, room)
    if wanted >= batch_size:
        wanted -= wanted % batch_size
    span = len(tokens) - seq_len - 1  # last valid start
    # Integer spacing >= seq_len because wanted <= room, so targets stay disjoint.
    starts = torch.tensor([i * span // max(wanted - 1, 1) for i in range(wanted)])
    batches = []
    for b in range(0, wanted, batch_size):
        batches.append(_windows(tokens, starts[b : b + batch_size], seq_len))
    return batches
