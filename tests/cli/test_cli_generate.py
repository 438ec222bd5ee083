"""`mod generate` writing to a terminal: what a model emits is shown, never obeyed."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from helpers import TINY, make_model, tiny_config
from recursion_helpers import mor_config

from mixture_of_depths import MoDConfig, MoDTransformer, generate
from mixture_of_depths.cli import main
from mixture_of_depths.data import ByteTokenizer
from mixture_of_depths.runtime.checkpoint import load_model, save_checkpoint

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
    monkeypatch.delenv("NO_COLOR", raising=False)
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
    assert old.out == new.out and new.err.startswith("take-rates over the 5 tokens fed")
    assert new.err.count("\n") == 1  # the take-rates alone
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


@pytest.mark.parametrize(
    "stdout,no_color,flags,coloured",
    [
        (Terminal, None, [], True),
        (Terminal, "1", [], False),
        (Terminal, "", [], True),  # an empty NO_COLOR asks for nothing (no-color.org)
        (io.StringIO, None, [], False),  # a pipe or a file
        (io.StringIO, "1", ["--color", "always"], True),
        (Terminal, None, ["--color", "never"], False),
    ],
    ids=["terminal", "NO_COLOR", "empty-NO_COLOR", "pipe", "forced", "never"],
)
def test_show_routing_colours_a_terminal_unless_no_color_and_when_forced(
    escaping_model, monkeypatch, stdout, no_color, flags, coloured
):
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    out = stdout()
    monkeypatch.setattr(sys, "stdout", out)
    argv = ["generate", str(escaping_model), "--prompt", "ab", "--max-new-tokens", "3",
            "--temperature", "0", "--show-routing", *flags]  # fmt: skip
    assert main(argv) == 0
    text = out.getvalue()
    assert bool(OURS.search(text)) == coloured
    assert text.endswith(")\n")  # the take-rates, and a newline to end on
    assert "routed blocks taken per token (of 1)" in OURS.sub("", text)


@pytest.mark.parametrize("kind", ["mod", "mode-staged", "mor-expert"])
def test_mod_generate_reports_the_take_rates_that_return_routing_recounts(tmp_path, capsys, kind):
    """The take-rates `mod generate` prints (stderr) are each router's share of the tokens fed
    through the model, prompt and generated: a recount of `generate(..., return_routing=True)`
    sampling the same tokens (a final EOS is never fed, so not counted)."""
    cfg = {
        "mod": tiny_config(vocab_size=257),
        "mode-staged": tiny_config(vocab_size=257, n_experts=2, layer_pattern="DR"),
        "mor-expert": mor_config(vocab_size=257),
    }[kind]
    ck = save_checkpoint(
        tmp_path / "ck", make_model(cfg, dtype=torch.float32), cfg, tokenizer=ByteTokenizer()
    )
    prompt, n = "def f(x):", 12
    assert main(["generate", str(ck), "--prompt", prompt, "--max-new-tokens", str(n),
                 "--seed", "3"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    model, _ = load_model(ck)
    tok = ByteTokenizer()
    ids = tok.encode(prompt)
    res = generate(model, [ids], n, temperature=0.8, eos_id=tok.eot_id, seed=3, return_routing=True)
    fed = res.routing[0][: len(ids) + len([t for t in res.tokens[0] if t != tok.eot_id])]
    took = fed.sum(0).tolist()
    assert 0 < sum(took) < fed.numel()  # precondition: the routers took some tokens, not all
    assert f"take-rates over the {len(fed)} tokens fed (prompt and generated): " in err
    for name, t in zip(res.router_names, took, strict=True):
        assert f"L{name} {t}/{len(fed)} {t / len(fed):.1%}" in err, name
    assert err.count("\n") == 1
