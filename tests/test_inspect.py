"""`mixture_of_depths.inspect.analyse` and its statistics, against oracles: the routes of a
forward pass, brute-force enumeration (the independence baseline), hand-made routings, the
closed form of Spearman's rho without ties (and scipy's, where installed)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from helpers import (
    dense_twin_with_same_weights,
    force_routing,
    make_model,
    random_tokens,
    tiny_config,
    unit_gates,
)

from mixture_of_depths.inspect import (
    analyse,
    bootstrap_spearman,
    independence_test,
    longest_run,
    loss_by,
    loss_by_run,
    poisson_binomial,
    ranks,
    spearman,
    text_class,
)


@pytest.mark.parametrize("routing", ["joint", "mlp_kv"])
def test_counts_are_the_routes_of_a_forward_pass(routing):
    model = make_model(tiny_config(routing=routing))
    x = random_tokens(3, 40, seed=2)
    rep = analyse(model, x, bootstrap=50)
    with torch.no_grad():
        causal = model(x, routing="causal")
        topk = model(x, routing="topk")
    want = torch.stack([r.mask for r in causal.routes], -1).reshape(3 * 40, -1)
    assert torch.equal(rep.taken, want)
    assert torch.equal(
        rep.taken_topk, torch.stack([r.mask for r in topk.routes], -1).reshape(120, -1)
    )
    k = model.config.capacity_tokens(40)
    assert (rep.taken_topk.reshape(3, 40, -1).sum(1) == k).all()  # top-k: exactly k per row
    assert rep.depth_hist.sum() == 120 and torch.equal(
        rep.depth_hist, torch.bincount(rep.depth, minlength=len(rep.router_names) + 1)
    )
    assert math.isclose(float(rep.independent_hist.sum()), 120, rel_tol=1e-9)
    logp = causal.logits.double().log_softmax(-1).reshape(120, -1)
    nxt = x[:, 1:].reshape(-1)
    has = torch.ones(3, 40, dtype=torch.bool)
    has[:, -1] = False
    has = has.reshape(-1)
    torch.testing.assert_close(
        rep.loss[has].double(), -logp[has].gather(-1, nxt[:, None])[:, 0], rtol=1e-5, atol=1e-5
    )
    assert rep.loss[~has].isnan().all()
    for name, rate in rep.take_rate.items():
        j = rep.router_names.index(name)
        assert rate == pytest.approx(rep.taken[:, j].double().mean().item())
    runs = loss_by_run(rep)
    assert sum(v["tokens"] for v in runs.values()) == 120


def test_a_model_taking_every_block_has_no_excess_over_its_dense_twin(monkeypatch):
    """Every token takes every routed block with gate 1: the model computes its dense twin, so the
    excess loss is zero (float64 round-off) in every group, and baseline == own loss."""
    unit_gates(monkeypatch)
    model = make_model(tiny_config(causal_router="predictor"))
    force_routing(model, True)
    dense = dense_twin_with_same_weights(model)
    x = random_tokens(2, 30, seed=4)
    rep = analyse(model, x, bootstrap=20, baseline=dense)
    assert rep.taken.all()
    ok = ~rep.loss.isnan()
    assert rep.excess[ok].abs().max() < 1e-10
    for row in loss_by_run(rep).values():
        assert abs(row["mean_excess"]) < 1e-10
        assert row["mean_baseline_loss"] == pytest.approx(row["mean_loss"], abs=1e-10)


def test_excess_by_group_is_the_mean_difference_of_two_forward_passes():
    model = make_model(tiny_config())
    other = make_model(tiny_config().dense_twin(), seed=7)
    x = random_tokens(3, 40, seed=5)
    rep = analyse(model, x, bootstrap=20, baseline=other)
    with torch.no_grad():
        a = model(x, routing="causal").logits.double().log_softmax(-1)
        b = other(x).logits.double().log_softmax(-1)
    nxt = x[:, 1:, None]
    diff = (b[:, :-1].gather(-1, nxt) - a[:, :-1].gather(-1, nxt))[..., 0]  # own - baseline loss
    depth = rep.depth.reshape(3, 40)[:, :-1]
    table = loss_by(rep, rep.depth)
    for k, row in table.items():
        sel = diff[depth == k]
        rows = [b for b in range(3) if (depth[b] == k).any()]
        if len(rows) > 1:  # the cluster-robust variance, row by row
            m = float(sel.mean())
            assert row["mean_excess"] == pytest.approx(m, abs=1e-9)
            dev = [float((diff[b][depth[b] == k] - m).sum()) for b in rows]
            var = len(rows) / (len(rows) - 1) * sum(d * d for d in dev) / len(sel) ** 2
            assert row["excess_half_width"] == pytest.approx(1.96 * var**0.5, rel=1e-9)
    assert "depth_vs_baseline_loss" in rep.correlations
    with pytest.raises(ValueError, match="vocab_size 62 differs"):
        analyse(model, x, baseline=make_model(tiny_config(vocab_size=62).dense_twin()))


def test_the_independence_baseline_is_the_poisson_binomial():
    assert torch.allclose(
        poisson_binomial(torch.tensor([0.5, 0.5])),
        torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64),
    )
    assert torch.allclose(
        poisson_binomial(torch.tensor([1.0, 0.0, 0.3])),
        torch.tensor([0, 0.7, 0.3, 0], dtype=torch.float64),
    )
    p = torch.rand(5, generator=torch.Generator().manual_seed(0)).double()
    brute = torch.zeros(6, dtype=torch.float64)
    for bits in itertools.product((0, 1), repeat=5):
        prob = 1.0
        for b, pi in zip(bits, p.tolist(), strict=True):
            prob *= pi if b else 1 - pi
        brute[sum(bits)] += prob
    torch.testing.assert_close(poisson_binomial(p), brute)


def test_the_independence_test_on_hand_made_routings():
    g = torch.Generator().manual_seed(3)
    col = torch.rand(400, generator=g) < 0.2
    same = torch.stack([col] * 4, 1)  # every router takes the same tokens: var = R^2 p(1-p)
    res = independence_test(same, n=200)
    assert res["variance_ratio"] == pytest.approx(4.0, rel=1e-12)
    assert res["p_value"] == pytest.approx(1 / 201)  # no shuffle comes close
    p = same.double().mean(0)
    share = float(col.double().mean())
    hist = torch.tensor([1 - share, 0, 0, 0, share], dtype=torch.float64)  # all or nothing
    want_tv = 0.5 * float((hist - poisson_binomial(p)).abs().sum())
    assert res["total_variation"] == pytest.approx(want_tv, rel=1e-12)
    spread = torch.zeros(400, 4, dtype=torch.bool)  # each token takes exactly one router
    spread[torch.arange(400), torch.arange(400) % 4] = True
    assert independence_test(spread, n=50)["variance_ratio"] == 0.0
    coins = torch.rand(4000, 4, generator=g) < torch.tensor([0.1, 0.2, 0.3, 0.4])
    res = independence_test(coins, n=200)
    assert abs(res["variance_ratio"] - 1) < 0.1 and res["p_value"] > 0.01


def test_longest_skip_run_on_a_hand_made_routing():
    skipped = torch.tensor(
        [[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool
    )
    assert longest_run(skipped).tolist() == [2, 0, 4, 2]


def test_spearman_against_the_closed_form_and_scipy():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(200, generator=g), torch.randn(200, generator=g)
    y = x + y  # correlated, no ties
    d = ranks(x) - ranks(y)
    n = 200
    assert spearman(x, y) == pytest.approx(
        1 - 6 * float(d.square().sum()) / (n * (n * n - 1)), rel=1e-12
    )
    assert ranks(torch.tensor([3.0, 1, 2, 2, 5])).tolist() == [4, 1, 2.5, 2.5, 5]
    assert math.isnan(spearman(torch.ones(5), torch.arange(5.0)))
    ties = torch.randint(0, 4, (300,), generator=g).double()
    noisy = ties + torch.randn(300, generator=g)
    ci = bootstrap_spearman(ties, noisy, n=200, seed=0)
    assert ci["low"] < ci["rho"] < ci["high"] and ci == bootstrap_spearman(
        ties, noisy, n=200, seed=0
    )
    # groups of one token each: the clustered bootstrap draws exactly what the plain one draws
    assert bootstrap_spearman(ties, noisy, n=50, seed=1, groups=torch.arange(300)) == (
        bootstrap_spearman(ties, noisy, n=50, seed=1)
    )
    # 12 rows of 50 tokens, each row one shared level of x and y plus a little noise: rho is high
    # only by chance across 12 rows, which the token bootstrap (600 "independent" pairs) hides
    rows = torch.arange(600) // 50
    gx, gy = torch.randn(12, generator=g), torch.randn(12, generator=g)
    cx = gx[rows] + 0.1 * torch.randn(600, generator=g)
    cy = gy[rows] + 0.1 * torch.randn(600, generator=g)
    plain = bootstrap_spearman(cx, cy, n=300, seed=0)
    clustered = bootstrap_spearman(cx, cy, n=300, seed=0, groups=rows)
    assert plain["rho"] == clustered["rho"]
    one_row = bootstrap_spearman(cx[:50], cy[:50], n=50, seed=0, groups=rows[:50])
    assert math.isnan(one_row["low"]) and math.isnan(one_row["high"])  # no interval from one row
    assert clustered["high"] - clustered["low"] > 4 * (plain["high"] - plain["low"])
    scipy_stats = pytest.importorskip("scipy.stats")
    assert spearman(ties, noisy) == pytest.approx(
        scipy_stats.spearmanr(ties, noisy).statistic, rel=1e-10
    )


def test_token_classes_and_extremes_on_a_hand_made_routing():
    from mixture_of_depths.inspect import Report, byte_class, class_table, extremes

    assert [byte_class(ord(c)) for c in " 7a_(\n"] == [
        "whitespace", "digits", "letters/identifiers", "letters/identifiers", "punctuation",
        "whitespace",
    ]  # fmt: skip
    assert byte_class(200) == byte_class(256) == byte_class(7) == "other"
    tokens = torch.tensor([ord(c) for c in "ab 1 ab"])
    taken = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1], [0, 0], [1, 1], [1, 0]], dtype=torch.bool)
    z = torch.zeros(7)
    rep = Report(["1", "3"], tokens, taken, taken, z[:, None].expand(7, 2), z, z,
                 torch.zeros(3), torch.zeros(3), torch.zeros(7, dtype=torch.long))  # fmt: skip
    table = class_table(rep)
    assert table["letters/identifiers"] == {"tokens": 4, "1": 1.0, "3": 0.5}
    assert table["whitespace"] == {"tokens": 2, "1": 0.0, "3": 0.0}
    assert table["digits"] == {"tokens": 1, "1": 1.0, "3": 1.0}
    words = {ord("a"): " foo", ord("b"): "bar_1", ord(" "): "\n\n", ord("1"): " 42"}
    by_text = class_table(rep, decode=lambda i: words[i])
    assert by_text["letters/identifiers"] == {"tokens": 4, "1": 1.0, "3": 0.5}
    assert by_text["whitespace"] == {"tokens": 2, "1": 0.0, "3": 0.0}
    assert by_text["digits"]["tokens"] == 1
    ex = extremes(rep, k=2, min_count=2)
    assert ex["most"] == [(ord("a"), 2.0, 2), (ord("b"), 1.0, 2)]
    assert ex["least"][0] == (ord(" "), 0.0, 2)


def test_text_classes_of_bpe_tokens():
    cases = {" (": "punctuation", "):\n": "punctuation", " foo": "letters/identifiers",
             "__init": "letters/identifiers", "x1": "letters/identifiers", " 2024": "digits",
             "\n    ": "whitespace", "": "mixed", " x+1": "mixed", "\ufffd": "mixed",
             "\u00e9t\u00e9": "letters/identifiers", "\u0663": "mixed"}  # fmt: skip
    assert {t: text_class(t) for t in cases} == cases


@pytest.mark.parametrize("routing", ["joint", "mlp_kv"])
def test_mod_inspect_writes_its_pictures_and_numbers(tmp_path, capsys, routing):
    from mixture_of_depths.cli import main
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    model = make_model(tiny_config(vocab_size=257, routing=routing), dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    out = tmp_path / "inspect"
    text = "def f(x):\n    return x + 1  # one\n" * 3
    assert main(["inspect", str(ckpt), "--text", text, "--out", str(out)]) == 0
    assert "rho depth~entropy" in capsys.readouterr().out
    for name in ("routing.png", "depth_hist.png", "skip_runs.png", "entropy.png"):
        assert (out / name).stat().st_size > 0
    page = (out / "index.html").read_text()
    assert page.count('class="tok"') == len(text)  # one element per token
    assert page.count("data:image/png;base64,") == 4
    assert "http" not in page.replace("http-equiv", "")  # self-contained: nothing to fetch
    report = (out / "report.md").read_text()
    assert f"{len(text)} held-out tokens" in report and "| letters/identifiers |" in report
    # the page shows report.md's tables as tables, not as raw markdown
    assert page.count("<table>") == report.count("\n|---") >= 5 and "<pre" not in page
    # the copy probe, in the numbers, the page and report.json: the probe run directly (oracle)
    from mixture_of_depths.probes import copy_probe

    probe = copy_probe(model)
    assert f"score {probe['score']:+.4f} nats" in report
    assert f"score {probe['score']:+.4f} nats" in page
    numbers = json.loads((out / "report.json").read_text())
    assert numbers["copy_probe"]["score"] == pytest.approx(probe["score"], abs=1e-9)
    assert numbers["copy_probe"]["take_second"] == pytest.approx(probe["take_second"], abs=1e-9)
    assert numbers["tokens"] == len(text) and numbers["routers"] == list(numbers["take_rate"])
    # attention reach, the probe run directly on the inspected tokens (oracle)
    from mixture_of_depths.probes import attention_reach

    reach = attention_reach(model, torch.tensor([list(text.encode())]))
    for got, want in zip(numbers["attention_reach"], reach, strict=True):
        assert {k: got[k] for k in ("layer", "call", "routed", "queries")} == {
            k: want[k] for k in ("layer", "call", "routed", "queries")
        }
        assert got["far_share_heads"] == pytest.approx(want["far_share_heads"], abs=1e-6)
    assert len(reach) == len(model.blocks) and "## How far back attention looks" in report
    assert sum(numbers["blocks_taken"]) == len(text)
    assert main(["inspect", str(ckpt), "--text", "", "--out", str(out)]) == 2
    assert "no tokens" in capsys.readouterr().err
    # a dense baseline on the same tokenizer: the excess columns; another tokenizer: refused
    dense = make_model(tiny_config(vocab_size=257).dense_twin(), dtype=torch.float32, seed=3)
    base = save_checkpoint(tmp_path / "dense", dense, dense.config, tokenizer=ByteTokenizer())
    argv = ["inspect", str(ckpt), "--text", text, "--out", str(out), "--baseline", str(base)]
    assert main(argv) == 0
    assert "depth~baseline loss" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert "excess (95% interval)" in report and "depth vs baseline loss" in report
    from mixture_of_depths.data import BPETokenizer

    (tmp_path / "corpus.txt").write_text("hello world, hello tokens\n" * 50)
    bpe = BPETokenizer.train([tmp_path / "corpus.txt"], vocab_size=300)
    other = make_model(tiny_config(vocab_size=bpe.vocab_size).dense_twin(), dtype=torch.float32)
    odd = save_checkpoint(tmp_path / "bpe", other, other.config, tokenizer=bpe)
    argv[-1] = str(odd)
    assert main(argv) == 2
    assert "another tokenizer" in capsys.readouterr().err


def test_the_committed_pages_show_their_numbers_as_tables():
    """docs/inspect/*/index.html show their report.md's tables as tables (the page once held
    them raw in one <pre>), and each page's numbers are its report.md's."""
    from pathlib import Path

    from mixture_of_depths.inspect.report import markdown_html

    root = Path(__file__).resolve().parents[1] / "docs" / "inspect"
    pages = sorted(root.glob("*/index.html"))
    assert len(pages) >= 2
    for page in pages:
        text, report = page.read_text(), (page.parent / "report.md").read_text()
        assert "<pre" not in text and text.count("<table>") == report.count("\n|---") >= 3
        assert f'<div class="numbers">{markdown_html(report)}</div>' in text, page


def test_the_page_renders_in_a_real_browser(tmp_path):
    """Headless Chromium from the system's packages renders the page with one element per token
    and no script errors; skipped where no such browser is installed."""
    import shutil
    import subprocess

    from mixture_of_depths.cli import main
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    names = ("chromium", "chromium-browser", "google-chrome", "chrome", "headless_shell")
    browser = next((b for b in map(shutil.which, names) if b), None)
    if browser is None:
        pytest.skip(f"no headless Chromium here (looked for {', '.join(names)})")
    model = make_model(tiny_config(vocab_size=257), dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    text = "x = [1, 2]\nprint(x)\n"
    assert main(["inspect", str(ckpt), "--text", text, "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "index.html").resolve()
    proc = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count('class="tok"') == len(text)
    assert "Uncaught" not in proc.stderr and "CONSOLE" not in proc.stderr


def test_statistics_of_constant_routing_say_why_they_are_undefined(tmp_path, capsys, monkeypatch):
    """Every token skips every routed block: rho and the variance ratio have no value (a constant
    has no variance). The printed line, report.md, the page and the plots' titles say so, never
    ``+nan`` or ``nanx``."""
    import matplotlib.axes

    from mixture_of_depths.cli import main
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    model = make_model(tiny_config(vocab_size=257, causal_router="predictor"), dtype=torch.float32)
    force_routing(model, False)
    ckpt = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    titles = []
    real = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(
        matplotlib.axes.Axes, "set_title", lambda ax, t, *a, **k: titles.append(t) or real(ax, t)
    )
    out = tmp_path / "inspect"
    text = "def f(x):\n    return x + 1\n" * 3
    assert main(["inspect", str(ckpt), "--text", text, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = (out / "report.md").read_text()
    page = (out / "index.html").read_text()
    numbers = page[page.index('<div class="numbers">') :]
    title = " ".join(titles)
    why = "undefined (routing is constant: no variance)"
    assert printed.count(why) == 2  # depth~entropy, depth~loss
    assert report.count(why) == 3 and numbers.count(why) == 3  # and the variance ratio
    assert title.count(why) == 3
    for where in (printed, report, numbers, title):
        assert "nan" not in where.lower()


def test_one_row_of_text_says_its_intervals_need_two_rows(tmp_path, capsys):
    """`--text` is one row (window): the bootstrap resamples whole rows and the excess interval
    is clustered by row, so one row has no interval. report.md and the page say so (it needs two
    or more) instead of "+nan to +nan" or "±nan"; two rows of held-out text give intervals."""
    from mixture_of_depths.cli import main
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.inspect import Report, interval_text
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    model = make_model(tiny_config(vocab_size=257, causal_router="predictor"), dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path / "ck", model, model.config, tokenizer=ByteTokenizer())
    dense = make_model(tiny_config(vocab_size=257).dense_twin(), dtype=torch.float32, seed=3)
    base = save_checkpoint(tmp_path / "dense", dense, dense.config, tokenizer=ByteTokenizer())
    out = tmp_path / "inspect"
    text = "def f(x):\n    return x + 1  # one\n" * 3
    argv = ["inspect", str(ckpt), "--text", text, "--out", str(out), "--baseline", str(base)]
    assert main(argv) == 0
    capsys.readouterr()
    numbers = json.loads((out / "report.json").read_text())
    assert (
        numbers["correlations"]["depth_vs_entropy"]["rho"]
        == numbers["correlations"]["depth_vs_entropy"]["rho"]
    )  # routing varies: rho has a value, only its interval has none
    report = (out / "report.md").read_text()
    page = (out / "index.html").read_text()
    numbers_html = page[page.index('<div class="numbers">') :]
    why = "no bootstrap interval: it resamples whole rows (windows) and needs two or more, here 1"
    assert report.count(why) == 3 and numbers_html.count(why) == 3  # entropy, loss, baseline
    assert "(no interval: one row)" in report
    for where in (report, numbers_html):
        assert "nan" not in where.lower()
    # two rows: an interval of numbers (the oracle: the Report's own bounds)
    rep = Report.__new__(Report)
    rep.tokens, rep.row_len = torch.zeros(4, dtype=torch.long), 2
    rep.loss = torch.tensor([1.0, float("nan"), 2.0, float("nan")])
    rep.correlations = {"depth_vs_entropy": {"rho": 0.5, "low": 0.1, "high": 0.9, "n": 4}}
    assert (
        interval_text(rep, "depth_vs_entropy")
        == "95% bootstrap interval over rows +0.1000 to +0.9000"
    )
    rep.correlations["depth_vs_loss"] = {"rho": 0.5, "low": math.nan, "high": math.nan, "n": 2}
    assert (
        interval_text(rep, "depth_vs_loss")
        == "no bootstrap interval: no resample had a defined rho"
    )


def test_inspect_refuses_an_out_folder_that_is_not_its_own_and_reruns_in_its_own(tmp_path, capsys):
    """--out over a folder of other files is refused before anything is written (export and
    convert refuse any non-empty folder); a previous output of `mod inspect` (its file names,
    its headings), such as the default <checkpoint>/../inspect, is rewritten in place."""
    from pathlib import Path

    from mixture_of_depths.cli import main
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    model = make_model(tiny_config(vocab_size=257), dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path / "run" / "checkpoint", model, model.config,
                           tokenizer=ByteTokenizer())  # fmt: skip
    argv = ["inspect", str(ckpt), "--text", "x = 1\n"]
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    (theirs / "report.md").write_text("# my report\n")
    assert main([*argv, "--out", str(theirs)]) == 2
    err = capsys.readouterr().err
    assert "not a previous mod inspect's output ('notes.txt', 'report.md')" in err
    assert "give a new or empty folder as --out" in err
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt", "report.md"]
    assert (theirs / "report.md").read_text() == "# my report\n"
    assert main([*argv, "--out", str(theirs / "notes.txt")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    from mixture_of_depths.cli.inspect import OUTPUTS, check_out

    assert main(argv) == 0 and main(argv) == 0  # the default folder, then again in place
    default = tmp_path / "run" / "inspect"
    assert sorted(p.name for p in default.iterdir()) == sorted(OUTPUTS)
    (default / ".report.md.q1w2.tmp").write_text("cut short")  # an interrupted write's leftover
    assert main(argv) == 0
    capsys.readouterr()
    # The pages in docs/ were written by mod inspect: recognised as such.
    check_out(Path(__file__).parents[1] / "docs" / "inspect" / "byte")


def test_a_baseline_that_cannot_score_the_tokens_is_refused_by_name(tmp_path, capsys):
    """Another vocabulary (same byte tokenizer) or a context shorter than the inspected rows:
    refused before the analysis, naming the --baseline, nothing written."""
    from mixture_of_depths.cli import main
    from mixture_of_depths.data import ByteTokenizer
    from mixture_of_depths.runtime.checkpoint import save_checkpoint

    def ckpt(name, **kw):  # noqa: ANN001, ANN003, ANN202
        m = make_model(tiny_config(**kw), dtype=torch.float32)
        return save_checkpoint(tmp_path / name, m, m.config, tokenizer=ByteTokenizer())

    model = ckpt("ck", vocab_size=257)
    wide = ckpt("wide", vocab_size=300, layer_pattern="D")
    short = ckpt("short", vocab_size=257, max_seq_len=16, layer_pattern="D")
    out = tmp_path / "inspect"
    argv = ["inspect", str(model), "--text", "x = [1, 2, 3]\n" * 3, "--out", str(out)]
    assert main([*argv, "--baseline", str(wide)]) == 2
    err = capsys.readouterr().err
    assert f"--baseline {wide} has vocab_size 300, {model} 257" in err
    assert main([*argv, "--baseline", str(short)]) == 2
    err = capsys.readouterr().err
    assert f"--baseline {short} has max_seq_len 16, shorter than the 42 tokens per row" in err
    assert "a shorter --text" in err
    assert not out.exists()


def test_nested_recursion_steps_are_not_tested_against_independent_coins():
    """MoR's steps are nested by construction (a token continues only if it took the step
    before), so the independence test would reject by design: it is left out for a recursive
    model, and still run for a MoD one."""
    mor = make_model(tiny_config(layer_pattern="D", recursions=3, recursion_capacities=(0.5, 0.3),
                                 causal_router="predictor"), dtype=torch.float32)  # fmt: skip
    tokens = torch.randint(
        0, mor.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)
    )
    assert analyse(mor, tokens, bootstrap=20).independence == {}
    mod = make_model(tiny_config(), dtype=torch.float32)
    assert "p_value" in analyse(mod, tokens, bootstrap=20).independence
