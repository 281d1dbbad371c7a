"""`treespec serve`'s HTTP front door, driven by the official openai client on a live loopback
server over a tiny float64 target that speaks bytes: the text equals the library's
(completions, chat, streamed or not, greedy and seeded), concurrent requests each equal their
run alone, stop strings are never passed, a client that leaves frees its rows, the queue bound
answers 429, every kind of bad input a 400 naming the field, one failing request a 500 that
leaves the others alone, and /metrics speaks Prometheus."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from treespec import DynamicTreeBuilder, SpeculativeGenerator, SpeculativeServer

from _serve_helpers import http, live_server, text_drafter, text_target
from _tiny import one_thread  # noqa: F401

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")

BUILDER = DynamicTreeBuilder(budget=6, depth=3, top_k=2)
MODEL = "tiny-bytes"


def make(max_queue: int = 8, max_batch: int = 4, step_delay: float = 0.0):
    from treespec.cli.serve.app import make_app

    target = text_target(dtype=torch.float64)
    server = SpeculativeServer(target, text_drafter(target), BUILDER)
    if step_delay:
        real = server.step

        def slow_step():
            time.sleep(step_delay)
            return real()

        server.step = slow_step
    return target, make_app(server, MODEL, max_queue=max_queue, max_batch=max_batch, default_max_tokens=16)


@pytest.fixture(scope="module")
def served():
    target, app = make()
    with live_server(app) as url:
        yield target, app, url, openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


def alone(target, prompt: str, n: int, chat: bool, temperature: float = 0.0, seed: int | None = None) -> str:
    gen = SpeculativeGenerator(target, text_drafter(target), BUILDER)
    return gen.generate(prompt, n, temperature=temperature, seed=seed, chat=chat).text


def streamed(stream) -> tuple[str, list]:
    parts, chunks = [], []
    for chunk in stream:
        chunks.append(chunk)
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            parts.append(piece or "")
    return "".join(parts), chunks


def test_greedy_text_equals_the_library_streamed_or_not(served) -> None:
    target, _, _, client = served
    want = alone(target, "The quick brown fox", 24, chat=False)
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len("The quick brown fox")
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    text, chunks = streamed(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=24,
                                                      temperature=0, stream=True))
    assert text == want and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].choices[0].finish_reason == "length"

    chat = alone(target, "Say hi", 20, chat=True)          # what `treespec generate --prompt` runs
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.content == chat and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 20
    text, chunks = streamed(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert text == chat
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20   # include_usage's chunk


def test_a_seeded_sampled_request_repeats_and_equals_the_library(served) -> None:
    target, _, _, client = served
    texts = [client.completions.create(model=MODEL, prompt="Once upon", max_tokens=20, temperature=1.0,
                                       top_p=0.9, seed=11).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]
    gen = SpeculativeGenerator(target, text_drafter(target), BUILDER)
    assert texts[0] == gen.generate("Once upon", 20, temperature=1.0, top_p=0.9, seed=11, chat=False).text
    other = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=20, temperature=1.0,
                                      top_p=0.9, seed=12).choices[0].text
    assert other != texts[0]


def test_four_concurrent_requests_each_equal_their_run_alone(served) -> None:
    """Different lengths, temperatures and endpoints at once; each equals the same request sent
    alone (greedy tokens always; seeded sampled ones in float64, where a batched row rounds as
    a single one)."""
    _, _, _, client = served
    specs = [("completion", "alpha", 30, 0.0, None), ("chat", "beta beta", 12, 1.0, 3),
             ("completion", "gamma gamma gamma", 21, 0.7, 4), ("chat", "delta", 7, 0.0, None)]

    def send(kind, prompt, n, t, seed, stream):
        if kind == "completion":
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=t, seed=seed,
                                            stream=stream)
            return streamed(out)[0] if stream else out.choices[0].text
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=n, temperature=t, seed=seed, stream=stream)
        return streamed(out)[0] if stream else out.choices[0].message.content

    solo = [send(*s, stream=False) for s in specs]
    results: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, send(*specs[i], stream=i % 2 == 0)))
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert results == solo


def test_stop_strings_are_never_streamed_past(served) -> None:
    target, _, _, client = served
    full = alone(target, "stop here", 40, chat=False)
    stop = full[9:12]
    cut = full.index(stop)
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=40, temperature=0,
                                  stop=[stop, "never-seen"])
    assert r.choices[0].text == full[:cut] and r.choices[0].finish_reason == "stop"
    text, chunks = streamed(client.completions.create(model=MODEL, prompt="stop here", max_tokens=40, temperature=0,
                                                      stop=stop, stream=True))
    assert text == full[:cut] and chunks[-1].choices[0].finish_reason == "stop"


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_client_that_leaves_mid_stream_is_cancelled_and_frees_its_rows() -> None:
    target, app = make(step_delay=0.02)
    front = app.state.front
    with live_server(app) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="a long one", max_tokens=400, temperature=0,
                                           stream=True)
        got = 0
        for chunk in stream:
            got += 1
            if got == 3:
                break
        assert front.engine.live == 1
        stream.close()                                      # the client hangs up
        wait_for(lambda: front.engine.live == 0)
        assert front.server.verifier.batch_size == 0 and front.server.live == ()
        assert front.server.drafter.keys == []               # drafter state freed too
        assert front.server.stats.new_tokens < 400
        metrics = http("GET", url.removesuffix("/v1") + "/metrics").text
        assert 'treespec_requests_total{outcome="cancelled"} 1.0' in metrics
        assert "\ntreespec_kv_rows 0.0\n" in metrics             # what the load test reads over HTTP
        r = client.completions.create(model=MODEL, prompt="after", max_tokens=5, temperature=0)
        assert r.choices[0].text == alone(target, "after", 5, chat=False)   # the server goes on


def test_past_the_queue_bound_the_answer_is_429_with_retry_after() -> None:
    _, app = make(max_queue=1, max_batch=1, step_delay=0.02)
    front = app.state.front
    with live_server(app) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        first = client.completions.create(model=MODEL, prompt="first", max_tokens=300, temperature=0, stream=True)
        next(iter(first))                                   # decoding: the batch (of 1) is full
        waiting: dict = {}
        t = threading.Thread(target=lambda: waiting.setdefault("r", client.completions.create(
            model=MODEL, prompt="second", max_tokens=4, temperature=0)))
        t.start()
        wait_for(lambda: front.engine.queue_depth == 1)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="third", max_tokens=4, temperature=0)
        assert e.value.status_code == 429 and int(e.value.response.headers["retry-after"]) >= 1
        assert "queue is full" in e.value.message
        first.close()
        t.join(timeout=60)
        assert waiting["r"].usage.completion_tokens == 4      # the queued one was served
        metrics = http("GET", url.removesuffix("/v1") + "/metrics").text
        assert 'treespec_requests_total{outcome="rejected_queue_full"} 1.0' in metrics


BAD = [  # (endpoint, body, status, field named)
    ("completions", {"prompt": "x", "max_tokens": 4, "bogus": 1}, 400, "bogus"),
    ("completions", {"prompt": "x", "max_tokens": "4"}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "seed": 1.5}, 400, "seed"),
    ("completions", {"prompt": "x", "stop": ["a", 3]}, 400, "stop"),
    ("completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, 999]}, 400, "prompt"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt": "x"}, 400, "prompt"),
]


@pytest.mark.parametrize("endpoint, body, status, field", BAD)
def test_bad_input_gets_a_4xx_naming_the_field(served, endpoint, body, status, field) -> None:
    _, _, url, _ = served
    r = http("POST", f"{url}/{endpoint}", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == field and field.split(".")[0].split("[")[0] in err["message"]


def test_malformed_json_and_context_overflow_say_what_and_how_much(served) -> None:
    _, app, url, client = served
    r = http("POST", f"{url}/completions", content=b'{"prompt": "x",')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = http("POST", f"{url}/completions", content=b'["x"]')
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:          # the real client, too
        client.completions.create(model=MODEL, prompt="x" * 10, max_tokens=5000)
    err = e.value.body
    assert err["param"] == "max_tokens"
    assert "context window of 1024 tokens" in err["message"] and "10 tokens + 5000" in err["message"]
    assert "use max_tokens <= 1008" in err["message"]                     # 1024 - 10 - budget 6
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * 1020, max_tokens=1)
    assert e.value.body["param"] == "prompt" and "has 1020 tokens" in e.value.body["message"]
    assert app.state.front.engine.live == 0


def test_an_exception_in_one_request_ends_it_alone_with_500(served) -> None:
    """A drafter that fails to start any request whose prompt holds '!': that request gets a 500
    with the message; one sent beside it (admitted in the same step) is unharmed."""
    target, app, _, client = served
    drafter = app.state.front.server.drafter
    real = drafter.begin
    bang = target.tokenizer("!")["input_ids"][0]

    def begin(key, prompt, features):
        if bang in prompt.tolist():
            raise RuntimeError("the drafter cannot start this prompt")
        return real(key, prompt, features)

    drafter.begin = begin
    try:
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("good", client.completions.create(
            model=MODEL, prompt="fine", max_tokens=10, temperature=0).choices[0].text))
        t.start()
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="bad!", max_tokens=10, temperature=0)
        t.join(timeout=60)
    finally:
        del drafter.begin
    assert e.value.status_code == 500 and "the drafter cannot start this prompt" in e.value.message
    assert out["good"] == alone(target, "fine", 10, chat=False)
    assert client.completions.create(model=MODEL, prompt="again", max_tokens=3).usage.completion_tokens == 3


def test_models_health_and_metrics(served) -> None:
    _, _, url, client = served
    client.completions.create(model=MODEL, prompt="count me", max_tokens=8, temperature=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    base = url.removesuffix("/v1")
    assert http("GET", f"{base}/health").json()["status"] == "ok"
    r = http("GET", f"{base}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in ('treespec_requests_total{outcome="length"}', "treespec_prompt_tokens_total",
                 "treespec_generation_tokens_total", "treespec_tau", 'treespec_acceptance_rate{position="1"}',
                 'treespec_draft_attempts_total{position="1"}', 'treespec_step_seconds_total{phase="draft"}',
                 'treespec_step_seconds_total{phase="verify"}', 'treespec_step_seconds_total{phase="other"}',
                 "treespec_queue_depth", "treespec_live_requests", "treespec_kv_rows",
                 "treespec_time_to_first_token_seconds_bucket",
                 "treespec_inter_token_latency_seconds_bucket"):
        assert name in text, name
    generated = next(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("treespec_generation_tokens_total"))
    assert generated >= 8


def test_the_serve_command_checks_its_flags_before_loading_a_model(capsys) -> None:
    from treespec.cli.main import main

    assert main(["serve", "--max-batch", "0"]) == 2
    assert "--max-batch must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--budget", "big"]) == 2
    assert "--budget must be an integer >= 1" in capsys.readouterr().err
    assert main(["serve", "--budget", "auto", "--min-confidence", "0.5"]) == 2
    assert "--min-confidence shapes a fixed tree; with --budget auto" in capsys.readouterr().err
    assert main(["serve", "--budget", "4", "--tree", "chain", "--draft-max-batch", "0"]) == 2
    assert "--draft-max-batch must be >= 1, got 0" in capsys.readouterr().err
    assert main(["serve", "--budget", "4", "--tree", "static", "--min-confidence", "0.5"]) == 2
    assert "min_confidence is an option of the" in capsys.readouterr().err


def test_a_numeric_budget_serves_the_tree_its_flags_name(monkeypatch) -> None:
    """--budget 4 --tree chain --min-confidence 0.5 --draft-max-batch 1 (Qwen's AVX2 serving
    preset): the server's builder is that chain, drafted while one request is live."""
    import treespec
    from treespec import ChainBuilder
    from treespec.cli import serve
    from treespec.cli.main import build_parser
    from treespec.targets.loader import tiny_target

    target = tiny_target(vocab_size=32, seed=0)
    monkeypatch.setattr(treespec, "load_target", lambda *a, **k: target)
    args = build_parser().parse_args(["serve", "--no-compile", "--drafter", "lookup", "--budget", "4", "--tree",
                                      "chain", "--min-confidence", "0.5", "--draft-max-batch", "1", "--threads", "1"])
    _, server = serve.build_server(args)
    assert isinstance(server.builder, ChainBuilder) and server.builder.budget == 4
    assert server.builder.config.min_confidence == 0.5 and server.draft_max_batch == 1


def test_the_serving_doc_openai_block_streams_from_a_live_server(served, capsys) -> None:
    """docs/serving.md's ``import openai`` block as written, pointed at this loopback server (its
    URL and model name put in place of the doc's): it streams the whole reply, which the server
    counts as one request of exactly max_tokens generated tokens (this target never stops early)."""
    from test_readme import doc_block

    _, _, url, _ = served
    code, where = doc_block("import openai")
    assert code.count('"http://127.0.0.1:8000/v1"') == 1 and code.count('"smollm2-135m"') == 1
    code = code.replace('"http://127.0.0.1:8000/v1"', repr(url)).replace('"smollm2-135m"', repr(MODEL))
    metrics_url = url.removesuffix("/v1") + "/metrics"

    def counter(name: str) -> float:
        return next(float(line.split()[-1]) for line in http("GET", metrics_url).text.splitlines()
                    if line.startswith(name))

    before = counter("treespec_generation_tokens_total"), counter('treespec_requests_total{outcome="length"}')
    capsys.readouterr()
    exec(compile(code, where, "exec"), {})
    printed = capsys.readouterr().out
    after = counter("treespec_generation_tokens_total"), counter('treespec_requests_total{outcome="length"}')
    assert printed.strip(), "the block printed nothing"
    assert after[0] - before[0] == 64 and after[1] - before[1] == 1   # the block's max_tokens=64, one request
