"""`mod serve`'s HTTP API against a live server, driven by the official `openai` client.

The oracles: each greedy completion served concurrently equals `generate_reference` for its
prompt alone; a stream concatenates to the whole answer; each bad request gets its 4xx naming
the field, and the server answers the next request; dropped streams free every KV page.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from http_helpers import (  # noqa: E402
    MAX_LEN,
    VOCAB,
    http_model,
    live_server,
    metrics,
    open_stream,
    reference,
    wait_idle,
)

from mixture_of_depths.data import ByteTokenizer  # noqa: E402
from mixture_of_depths.generate import generate  # noqa: E402

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():  # noqa: ANN201
    return http_model()


@pytest.fixture(scope="module")
def live(model):  # noqa: ANN001, ANN201
    with live_server(model, max_rows=4, page_size=4) as (engine, server):
        yield engine, server


def client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


PROMPTS = ["def f(x):", [5, 200, 17, 99, 3], "import os\n", [256 - 1] * 3, "class A", "x = [1, 2"]


def _ids(prompt: str | list[int]) -> list[int]:
    return TOK.encode(prompt) if isinstance(prompt, str) else prompt


def test_concurrent_greedy_completions_equal_the_reference(model, live):  # noqa: ANN001
    _, server = live
    c = client(server)
    lens = [7, 12, 5, 9, 12, 3]

    def ask(i: int):  # noqa: ANN202
        return c.completions.create(
            model="mod", prompt=PROMPTS[i], max_tokens=lens[i], temperature=0,
            extra_body={"return_token_ids": True},
        )  # fmt: skip

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(ask, range(len(PROMPTS))))
    for i, r in enumerate(answers):
        exp = reference(model, _ids(PROMPTS[i]), lens[i])
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == exp, i
        assert choice.text == TOK.decode(exp), i
        assert choice.finish_reason == ("length" if len(exp) == lens[i] else "stop"), i
        assert r.usage.prompt_tokens == len(_ids(PROMPTS[i]))
        assert r.usage.completion_tokens == len(exp)
        assert r.object == "text_completion" and r.model == "mod"


def test_seeded_samples_stop_strings_and_ignore_eos_are_the_libraries(model, live):  # noqa: ANN001
    """A seeded sampled completion is `generate`'s with that seed for the prompt alone; a stop
    string cuts the greedy answer before its first occurrence; ignore_eos runs to max_tokens."""
    _, server = live
    c = client(server)
    prompt = TOK.encode("for i in")
    ids = {"return_token_ids": True}
    kw = dict(model="mod", prompt=prompt, max_tokens=20)
    sampled = dict(temperature=0.9, top_p=0.95, seed=11)
    r = c.completions.create(**kw, **sampled, extra_body={**ids, "top_k": 40})
    exp = generate(model, [prompt], 20, **sampled, top_k=40, eos_id=TOK.eot_id).tokens[0]
    exp = [t for t in exp if t != TOK.eot_id]
    assert r.choices[0].model_extra["token_ids"] == exp
    full = TOK.decode(exp)
    stops = [ch for ch in full[2:] if ch.isascii() and ch.isprintable()]
    assert stops, f"no stop-string candidate in the sampled answer {full!r}"
    cut = c.completions.create(**kw, **sampled, stop=[stops[0], "\x00never"],
                               extra_body={"top_k": 40})  # fmt: skip
    assert cut.choices[0].text == full[: full.index(stops[0])]
    assert cut.choices[0].finish_reason == "stop"
    long = c.completions.create(**kw, temperature=0, extra_body={**ids, "ignore_eos": True})
    assert long.choices[0].model_extra["token_ids"] == reference(model, prompt, 20, eos=False)
    assert long.usage.completion_tokens == 20


def test_a_stream_concatenates_to_the_whole_answer(model, live):  # noqa: ANN001
    _, server = live
    c = client(server)
    whole = c.completions.create(model="mod", prompt="def g(y):", max_tokens=14, temperature=0)
    chunks = list(
        c.completions.create(
            model="mod", prompt="def g(y):", max_tokens=14, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == whole.choices[0].finish_reason and set(finals[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )
    echoed = c.completions.create(
        model="mod", prompt="def g(y):", max_tokens=14, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "def g(y):" + whole.choices[0].text


# (body, status, param): each names the field it is about
BAD = [
    ({"prompt": "x", "max_tokens": "16"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": 12}, 400, "prompt"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0.0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "y" * (MAX_LEN + 1), "max_tokens": 1}, 400, None),  # max_tokens or prompt
    ({"prompt": [1, VOCAB, 2]}, 400, "prompt"),
    ({"prompt": [1, -1]}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [[1], [2]]}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"prompt": "x\ud800"}, 400, "prompt"),  # a lone surrogate: valid JSON, not text
    ({"prompt": "x", "stop": "\udfff"}, 400, "stop"),
    ({"prompt": "x", "stop": ["ok", "a\ud800b"]}, 400, "stop"),
]


def test_each_bad_request_gets_its_4xx_and_the_server_keeps_answering(live):  # noqa: ANN001
    _, server = live
    url = f"{server.url}/v1/completions"
    with httpx.Client(timeout=30) as h:
        for body, status, param in BAD:  # json.dumps escapes a lone surrogate; httpx's json= cannot
            r = h.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], body
            if param is not None:
                assert err["param"] == param, (body, err)
            else:
                assert err["param"] in ("prompt", "max_tokens"), (body, err)
            ok = h.post(url, json={"prompt": "ok", "max_tokens": 2, "temperature": 0})
            assert ok.status_code == 200, (body, ok.text)
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # under the size limit
        for raw in (b"{not json", b'{"prompt": "x", "temperature": NaN}', b"[1, 2]", deep):
            r = h.post(url, content=raw, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
        r = h.post(url, content=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413, r.text

        def chunked():  # no Content-Length: the limit counts the bytes as they come
            yield b'{"prompt": "'
            for _ in range(300):
                yield b"x" * 4096
            yield b'"}'

        json_type = {"Content-Type": "application/json"}
        assert h.post(url, content=chunked(), headers=json_type).status_code == 413
        assert h.get(f"{server.url}/v1/nothing").json()["error"]["code"] == "not_found"
    c = client(server)
    with pytest.raises(openai.NotFoundError) as exc:
        c.completions.create(model="other", prompt="x", max_tokens=2)
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        c.completions.create(model="mod", prompt="x", max_tokens=2, top_p=2.0)
    assert bad.value.param == "top_p"
    assert c.completions.create(model="mod", prompt="x", max_tokens=2).choices[0].text is not None
    m = metrics(server.url)
    assert m["mod_http_errors_total"]["400"] >= len(BAD) - 1


def test_models_health_and_metrics(live):  # noqa: ANN001
    _, server = live
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["mod"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("mod_requests_total", "mod_tokens_generated_total", "mod_queue_depth",
                 "mod_active_rows", "mod_kv_pages_in_use", "mod_take_rate"):  # fmt: skip
        assert f"# TYPE {name} " in text and f"# HELP {name} " in text, name
    assert 'mod_kv_pages_in_use{layer="' in text and 'mod_take_rate{layer="' in text
    before = metrics(server.url)["mod_tokens_generated_total"]
    r = c.completions.create(model="mod", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    after = metrics(server.url)["mod_tokens_generated_total"]
    assert after - before >= r.usage.completion_tokens


def test_dropped_streams_free_their_rows_and_pages(live):  # noqa: ANN001
    _, server = live
    n_new = MAX_LEN - 5
    before = wait_idle(server.url)["mod_tokens_generated_total"]

    def drop(i: int) -> None:
        sock = open_stream(server.port, {"prompt": [i % 200 + 1] * 4, "max_tokens": n_new,
                                         "temperature": 0, "ignore_eos": True})  # fmt: skip
        sock.close()

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(drop, range(100)))
    m = wait_idle(server.url)
    made = m["mod_tokens_generated_total"] - before
    assert made < 100 * n_new / 2, f"{made} tokens: the dropped requests ran on"
    assert m["mod_requests_running"] == 0 and m["mod_queue_depth"] == 0
    assert all(v == 0 for v in m["mod_kv_pages_in_use"].values()), m["mod_kv_pages_in_use"]
    # still serving; ignore_eos: a sampled first token may be EOS (0 tokens, a flaky check)
    r = client(server).completions.create(
        model="mod", prompt="a", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens >= 1


def _hammer(model, server, n_requests: int, n_threads: int) -> None:  # noqa: ANN001
    c = client(server)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + i % 9)] for i in range(n_requests)]
    n_new = [2 + i % 11 for i in range(n_requests)]
    lock, got = threading.Lock(), {}

    def ask(i: int) -> None:
        r = c.completions.create(model="mod", prompt=prompts[i], max_tokens=n_new[i],
                                 temperature=0, extra_body={"return_token_ids": True})  # fmt: skip
        with lock:
            got[i] = r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(n_threads) as pool:
        list(pool.map(ask, range(n_requests)))
    for i in range(n_requests):
        assert got[i] == reference(model, prompts[i], n_new[i]), i
    m = wait_idle(server.url)
    assert all(v == 0 for v in m["mod_kv_pages_in_use"].values())


def test_a_small_hammer_is_all_correct_and_leaks_no_page(model, live):  # noqa: ANN001
    _hammer(model, live[1], n_requests=24, n_threads=8)


@pytest.mark.slow
def test_200_requests_from_32_threads_are_all_correct_and_leak_no_page(model, live):  # noqa: ANN001
    _hammer(model, live[1], n_requests=200, n_threads=32)
