"""`mod generate` writing to a terminal: what a model emits is shown, never obeyed."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from helpers import TINY

from mixture_of_depths import MoDConfig, MoDTransformer
from mixture_of_depths.cli import main
from mixture_of_depths.data import ByteTokenizer
from mixture_of_depths.runtime.checkpoint import save_checkpoint

ESC = 0x1B
OURS = re.compile("\x1b\\[38;5;\\d+m|\x1b\\[0m")  # --show-routing's colours


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture()
def escaping_model(tmp_path):  # noqa: ANN001, ANN201
    """A checkpoint whose model emits ESC after any prompt: every block's weights are zero, so
    the last hidden state is the (one, shared) embedding, which only ESC's head row matches."""
    cfg = MoDConfig(**TINY, vocab_size=257, tie_embeddings=False)
    model = MoDTransformer(cfg)
    with torch.no_grad():
        for p in model.blocks.parameters():
            p.zero_()
        model.embed.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[ESC] = 1.0
    return save_checkpoint(tmp_path / "ck", model, cfg, tokenizer=ByteTokenizer())


def test_visible_escapes_controls_but_newline_and_tab():
    from mixture_of_depths.cli.generate import visible

    text = "é\tx\n\x1b[31m\x07\x9b日本\x7f\r\x00"
    assert visible(text) == "é\tx\n\\x1b[31m\\x07\\x9b日本\\x7f\\x0d\\x00"


@pytest.mark.parametrize("routing", [False, True], ids=["plain", "show-routing"])
def test_control_bytes_a_model_emits_are_shown_as_escapes_on_a_terminal(
    escaping_model, monkeypatch, routing
):
    argv = ["generate", "--checkpoint", str(escaping_model), "--prompt", "é\tx\n",
            "--max-new-tokens", "3", "--temperature", "0"]  # fmt: skip
    argv += ["--show-routing"] if routing else []
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    assert main(argv) == 0
    text = OURS.sub("", out.getvalue())  # our colours, when asked for, are real escapes
    if routing:
        assert OURS.search(out.getvalue())
        text = text.split("\n\n")[0] + "\n"  # the stream, before the legend
    assert text == "é\tx\n" + "\\x1b" * 3 + "\n"  # whole characters, newline and tab as they are
    assert "\x1b" not in text
    piped = io.StringIO()  # not a terminal: the model's text as it is
    monkeypatch.setattr(sys, "stdout", piped)
    assert main(argv) == 0
    assert OURS.sub("", piped.getvalue()).startswith("é\tx\n" + "\x1b" * 3)


def test_the_checkpoint_comes_first_and_the_old_flag_still_works(escaping_model, capsys):
    """One convention: a command that reads a checkpoint takes it as its first positional
    argument; `--checkpoint` still works, with a note on stderr."""
    ck = str(escaping_model)
    args = ["--prompt", "ab", "--max-new-tokens", "3", "--temperature", "0"]
    assert main(["generate", ck, *args]) == 0
    new = capsys.readouterr()
    assert main(["generate", "--checkpoint", ck, *args]) == 0
    old = capsys.readouterr()
    assert old.out == new.out and new.err == ""
    assert "--checkpoint is deprecated: give the checkpoint first: mod generate CKPT" in old.err
    assert main(["generate", *args]) == 2
    assert "mod generate: error: give a checkpoint: mod generate CKPT" in capsys.readouterr().err
    assert main(["generate", ck, "--checkpoint", ck, *args]) == 2
    assert "give the checkpoint once" in capsys.readouterr().err
    assert main(["flops", ck]) == 0
    flops = capsys.readouterr()
    assert main(["flops", "--checkpoint", ck]) == 0
    old = capsys.readouterr()
    assert old.out == flops.out and "mod flops CKPT" in old.err
    assert main(["flops", "--preset", "tiny"]) == 0  # a preset needs no checkpoint


def test_a_tiny_temperature_in_mod_generate_is_greedy(escaping_model, capsys):
    ck = str(escaping_model)
    outs = []
    for t in ("0", "1e-40", "5e-324"):
        assert main(["generate", ck, "--prompt", "x", "--max-new-tokens", "4",
                     "--temperature", t, "--seed", "1"]) == 0  # fmt: skip
        outs.append(capsys.readouterr().out)
    assert outs[1] == outs[2] == outs[0]
