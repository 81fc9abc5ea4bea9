"""The OpenAI-compatible server, driven as a user's tools drive it: a real
server process on a free port, the real ``openai`` client."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.parse
import urllib.request

import mlx_lm
import openai
import pytest

from mlx_streaming.testing.helpers import Server, free_port

MEMO = "X-MLX-Streaming-Memo"


@pytest.fixture(scope="module")
def server(models):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    # One request at a time: the admission tests count on it.
    s = Server(stream_dir, "--slots-per-layer", "4", "--max-queue", "0", "--memo-mb", "4",
               "--decode-concurrency", "1")
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def test_chat_and_completions_stream_and_not(server):
    c = server.client
    chat = c.chat.completions.create(model="default_model", max_tokens=6, temperature=0,
                                     messages=[{"role": "user", "content": "def f(x):"}])
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 6
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="default_model", max_tokens=6, temperature=0, stream=True,
        messages=[{"role": "user", "content": "def f(x):"}])]
    assert "".join(pieces) == chat.choices[0].message.content
    text = c.completions.create(model="default_model", prompt="import os", max_tokens=5,
                                temperature=0)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 5
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="default_model", prompt="import os", max_tokens=5, temperature=0, stream=True))
    assert streamed == text.choices[0].text


def test_the_model_may_be_named_by_its_id(server):
    model_id = server.client.models.list().data[0].id
    request = dict(prompt="import os", max_tokens=4, temperature=0.5, seed=3)
    by_id = server.client.completions.create(model=model_id, **request)
    default = server.client.completions.create(model="default_model", **request)
    assert by_id.choices[0].text == default.choices[0].text
    for field in ("draft_model", "adapters"):
        status, _, reply = server.post("/v1/completions", {"prompt": "x", field: "/tmp"})
        assert status == 400 and reply["error"]["param"] == field


def test_greedy_token_ids_equal_mlx_lm_resident(server, models):
    src, _ = models.get("qwen3_moe", quantized=True)
    model, tokenizer = mlx_lm.load(str(src))
    prompt = "class Foo:"
    expected = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=12)]
    status, _, body = server.post("/v1/completions", dict(
        prompt=prompt, max_tokens=12, temperature=0, logprobs=0, seed=1))
    assert status == 200
    # A token that is part of a character shows its vocabulary entry.
    texts = [tokenizer.decode([t]) for t in expected]
    texts = [text if "\ufffd" not in text else tokenizer.convert_ids_to_tokens(t)
             for t, text in zip(expected, texts)]
    assert body["choices"][0]["logprobs"]["tokens"] == texts


def test_stop_strings(server, models):
    """mlx-lm matches stop strings on tokens: stop at a whole token of the
    greedy continuation."""
    _, tokenizer = mlx_lm.load(str(models.get("qwen3_moe", quantized=True)[0]))
    request = dict(prompt="for i in range(", max_tokens=16, temperature=0)
    _, _, body = server.post("/v1/completions", dict(request, logprobs=0))
    full = body["choices"][0]["text"]
    pieces = body["choices"][0]["logprobs"]["tokens"]
    at = next(i for i, p in enumerate(pieces)
              if i >= 2 and p.strip() and p.isascii() and p.isprintable())
    cut = server.client.completions.create(model="default_model", stop=[pieces[at]],
                                           **request).choices[0]
    assert cut.finish_reason == "stop"
    assert full.startswith(cut.text) and len(cut.text) < len(full)


@pytest.mark.parametrize("body, raw, status, code", [
    (None, b"{not json", 400, None),
    ({"prompt": "x", "max_tokens": -5}, None, 400, None),
    ({"prompt": "x", "max_tokens": 0}, None, 400, None),
    ({"prompt": "x", "model": "gpt-4"}, None, 404, "model_not_found"),
    ({"prompt": "x", "temperature": "hot"}, None, 400, None),
    ({"max_tokens": 3}, None, 400, None),
    ({"prompt": "def " * 1100, "max_tokens": 3}, None, 400, "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": 10**12}, None, 400, "context_length_exceeded"),
    ({"prompt": "x", "logit_bias": {"99999999": 5}}, None, 400, None),  # was a segfault
    ({"prompt": "x", "logit_bias": {"1": [1]}}, None, 400, None),
    ({"prompt": ""}, None, 400, None),
    ({"prompt": "x", "stop": 5}, None, 400, None),
    ({"prompt": "x", "seed": 10**30, "temperature": 1}, None, 400, None),
    ({"prompt": "x", "stream": True, "stream_options": "x"}, None, 400, None),
    ({"prompt": "x", "top_p": 5}, None, 400, None),  # refused by mlx-lm, reworded here
    ({"prompt": "x", "top_k": -1}, None, 400, None),
    # mlx-lm's sampler raises on these, and left its random state broken:
    # every later sampled request failed
    ({"prompt": "x", "temperature": 1, "top_k": 10**6}, None, 400, None),
    ({"prompt": "x", "temperature": 1, "xtc_probability": 0.5, "xtc_threshold": 0.7}, None,
     400, None),
    (None, b'{"prompt": "x", "temperature": 0.5, "frequency_penalty": NaN}', 400, None),
    ({"prompt": [1, 2, 3]}, None, 400, None),  # mlx-lm encodes the prompt as text
    ({"prompt": "x", "presence_penalty": 10**400}, None, 400, None),  # not a 500
    ({"prompt": "x", "stop": ["ab" * 300]}, None, 400, None),  # memory mlx-lm keeps
    # Found by a hostile probe: each was a 200 of the wrong kind, a 500 or a
    # 400 quoting a Python exception.
    ({"prompt": "x", "temperature": 1e-38}, None, 400, None),  # 1/temp overflowed: noise
    ({"prompt": "x", "n": 2}, None, 400, None),  # answered with one choice
    (None, b'{"prompt": "x", "a": ' + b"[" * 3000 + b"]" * 3000 + b"}", 400, None),
    ({"prompt": "x" * 100, "max_tokens": 1000}, None, 400, "context_length_exceeded"),
    ({"prompt": "x", "logprobs": 2, "stream": True}, None, 400, None),
    ({"prompt": "x", "logprobs": 99}, None, 400, None),
])
def test_invalid_requests_get_openai_errors(server, body, raw, status, code):
    got, _, reply = server.post("/v1/completions", body, raw)
    assert got == status, reply
    error = reply["error"]
    assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"
    assert error["code"] == code


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments | tojson }})"
    "{% endfor %}\n{% endfor %}{% for d in documents or [] %}{{ d.title }}{% endfor %}"
    "assistant:")


@pytest.fixture(scope="module")
def chat_model(models, tmp_path_factory):
    """The qwen3_moe model with a chat template that renders content, tool
    calls and documents."""
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    copy = tmp_path_factory.mktemp("chat") / "stream"
    shutil.copytree(stream_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return copy


@pytest.fixture(scope="module")
def chat_server(chat_model):
    s = Server(chat_model, "--slots-per-layer", "4")
    yield s
    s.stop()


PYTHON_WORDS = ("object is not", "unsupported operand", "got multiple values", "Traceback",
                "unpack", "truth value", "input_embeddings")


@pytest.mark.parametrize("extra, param, words", [
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "must be a string"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages", "with a 'type'"),
    ({"messages": [{"role": "user", "content": [{"text": 5}]}]}, "messages", "with a 'type'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages",
     "string 'text'"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": "x"}]}, "messages",
     "'tool_calls' must be a list"),
    ({"messages": [{"role": "assistant", "content": "",
                    "tool_calls": [{"function": {"name": 5}}]}]}, "messages", "string 'name'"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]}, "messages", "JSON"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "may not set"),
    ({"chat_template_kwargs": {"return_tensors": "np"}}, "chat_template_kwargs", "may not set"),
    ({"chat_template_kwargs": {"documents": 5}}, "chat_template_kwargs", "list of objects"),
    ({"chat_template_kwargs": {"chat_template": ""}}, "chat_template_kwargs", "non-empty"),
    ({"chat_template_kwargs": {"chat_template": "{{ raise_exception('no way') }}"}}, None,
     "chat template could not be applied"),
    ({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, None, "text"),
])
def test_chat_template_fields_get_400s_in_words_of_the_api(chat_server, extra, param, words):
    """Found by a hostile probe on a model with a chat template: 500s, or
    400s quoting Python ("'int' object is not iterable", "too many values
    to unpack"); now 400s naming the field, and the log line says 400."""
    body = dict({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, **extra)
    got, _, reply = chat_server.post("/v1/chat/completions", body)
    assert got == 400 and reply["error"]["param"] == param, reply
    message = reply["error"]["message"]
    assert words in message and not any(w in message for w in PYTHON_WORDS), message


def test_a_chat_template_renders_valid_tool_calls_and_documents(chat_server):
    """What the checks let through works: tool calls with arguments as a
    JSON string or object, and documents."""
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"id": "2", "type": "function", "function": {"name": "g", "arguments": {"b": 2}}}]
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                         {"role": "assistant", "content": None, "tool_calls": calls},
                         {"role": "tool", "content": "3"}],
            "max_tokens": 2, "chat_template_kwargs": {"documents": [{"title": "t"}]}}
    got, _, reply = chat_server.post("/v1/chat/completions", body)
    assert got == 200, reply


def test_rejected_requests_are_logged_with_the_status_sent(chat_model):
    """mlx-lm's refusals go out as 400s (it sends 404s): the log line said
    404."""
    s = Server(chat_model, "--slots-per-layer", "4")
    try:
        body = {"messages": [{"role": "user", "content": [{"type": "bogus"}]}], "max_tokens": 2}
        assert s.post("/v1/chat/completions", body)[0] == 400
        assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
        s.wait_for_log("POST /v1/completions 200")
    finally:
        err = s.stop()
    assert "POST /v1/chat/completions 400" in err and " 404" not in err, err
    assert "POST /v1/completions 200" in err, err


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": 5}, "tools", "must be a list of objects"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "may not set"),
    ({"chat_template_kwargs": 5}, "chat_template_kwargs", "must be an object"),
    ({"role_mapping": 5}, "role_mapping", "must be an object of strings"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages", "not valid Unicode"),
])
def test_chat_fields_get_messages_of_their_own(server, extra, param, words):
    """Each was a 400 quoting a Python exception ("'int' object is not
    iterable", "got multiple values for keyword argument")."""
    body = dict({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, **extra)
    got, _, reply = server.post("/v1/chat/completions", body)
    assert got == 400 and reply["error"]["param"] == param, reply
    assert words in reply["error"]["message"]


@pytest.mark.parametrize("prompt", ["import os", "Beautiful is", "é ü ©"])
def test_completions_take_logprobs_as_openai_does(server, prompt):
    """``logprobs: n`` (the completions API's integer): the chosen tokens'
    log probabilities and the top n of each, in the completions format; a
    chosen token is found in its row by its text, and the offsets point
    into the completion's text (whose first token may have lost its leading
    space: they were the sums of the tokens' lengths)."""
    reply = server.client.completions.create(model="default_model", prompt=prompt,
                                             max_tokens=4, temperature=0, logprobs=2)
    lp, text = reply.choices[0].logprobs, reply.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    # OpenAI's defaults sent as null are the defaults.
    status, _, plain = server.post("/v1/completions", {
        "prompt": prompt, "max_tokens": None, "logprobs": None, "best_of": None, "n": None,
        "stop": None, "temperature": 0})
    assert status == 200 and "logprobs" not in plain["choices"][0], plain
    # Greedy: the chosen token is the likeliest, under its own text.
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(chosen) == pytest.approx(max(top.values()))
    ends = lp.text_offset[1:] + [len(text)]
    assert lp.text_offset[0] == 0 and ends == sorted(ends)
    for token, start, end in zip(lp.tokens, lp.text_offset, ends):
        segment = text[start:end]  # a held-back byte may come out as U+FFFD with the next
        assert token.endswith(segment) or segment.endswith(token) \
            or "\ufffd" in token + segment, (lp, text)


@pytest.mark.parametrize("messages", ["hi", [], [{"content": "no role"}], None])
def test_invalid_chat_messages(server, messages):
    got, _, reply = server.post("/v1/chat/completions", {"messages": messages})
    assert got == 400 and reply["error"]["param"] == "messages"


def test_prompts_beyond_the_context_are_refused_before_they_run(server):
    chat = {"messages": [{"role": "user", "content": "def " * 1100}], "max_tokens": 2}
    got, _, reply = server.post("/v1/chat/completions", chat)  # no chat template here
    assert got == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    start = time.monotonic()
    got, _, reply = server.post("/v1/completions", {"prompt": "x" * 4_000_000})
    assert got == 400 and "characters" in reply["error"]["message"], reply
    assert time.monotonic() - start < 10  # not tokenized: refused on its length


def test_image_parts_are_refused_for_a_text_model(server):
    with socket.socket() as s:  # an address the server must not fetch
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        url = "http://127.0.0.1:%d/secret.png" % s.getsockname()[1]
        part = {"type": "image_url", "image_url": {"url": url}}
        got, _, reply = server.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]})
        assert got == 400 and reply["error"]["param"] == "messages", reply
        s.settimeout(0.5)
        with pytest.raises(socket.timeout):
            s.accept()


def test_sampling_values_that_take_no_effect_are_accepted(server):
    """Greedy decoding ignores top_k, and XTC off ignores its threshold, as
    in mlx-lm."""
    for extra in ({"temperature": 0, "top_k": 10**6},
                  {"temperature": 0.5, "xtc_probability": 0.0, "xtc_threshold": 0.9},
                  {"temperature": 0.5, "top_k": 5, "presence_penalty": -1}):
        got, _, reply = server.post("/v1/completions", dict(prompt="x", max_tokens=2, **extra))
        assert got == 200, (extra, reply)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})[0] == 200


def test_the_listen_backlog_holds_a_burst_of_clients(server):
    """socketserver listens with a backlog of 5: clients arriving together
    beyond it waited on TCP retransmits, or were reset, before admission
    could answer them 429."""
    import shutil

    if shutil.which("ss") is None:
        pytest.skip("needs ss (iproute2) to read the backlog")
    out = subprocess.run(["ss", "-ltnH", f"sport = :{server.port}"], capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] == "LISTEN" and int(out[2]) >= 128, out  # Send-Q: the backlog


def test_oversized_or_truncated_bodies(server):
    for length in (10**12, 10**30):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d"
                     b"\r\n\r\n{" % length)
        assert sock.recv(100).startswith(b"HTTP/1.0 413"), length
        sock.close()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100"
                 b"\r\n\r\n{\"prompt\": ")
    sock.close()  # gone mid-body: nothing to answer
    assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    server.wait_for_log("POST /v1/completions client left mid-body")
    assert not any("None" in line for line in server.lines), "".join(server.lines)


def test_memo_stays_bounded_with_large_requests(models):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    s = Server(stream_dir, "--slots-per-layer", "4", "--memo-mb", "0.5")
    try:
        for i in range(6):
            body = {"prompt": f"x{i}", "max_tokens": 1, "temperature": 0, "junk": "j" * 200_000}
            assert s.post("/v1/completions", body)[0] == 200
        with urllib.request.urlopen(s.url + "/v1/stats") as r:
            memo = json.loads(r.read())["memo"]
        assert memo["bytes"] <= 0.5e6 and memo["entries"] <= 2
    finally:
        assert "Traceback" not in s.stop()


def test_port_in_use_is_one_line(server, models):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    for port in (str(server.port), "99999"):
        proc = subprocess.run([sys.executable, "-m", "mlx_streaming.server", "--model",
                               str(stream_dir), "--port", port], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert "--port" in proc.stderr.strip().splitlines()[-1]


def test_openai_client_sees_the_errors(server):
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model="default_model", prompt="x", max_tokens=-1)


def test_busy_server_answers_429_then_serves(server):
    """--max-queue 0: while one request runs, another is refused at once."""
    started = threading.Event()
    done = []

    def long_request():
        stream = server.client.completions.create(model="default_model", prompt="def ",
                                                  max_tokens=300, temperature=0.7, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                started.set()
        done.append(True)

    t = threading.Thread(target=long_request)
    t.start()
    assert started.wait(60)
    status, headers, reply = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                             "temperature": 0.5})
    assert status == 429 and headers.get("Retry-After") == "1", reply
    assert reply["error"]["type"] == "rate_limit_error"
    t.join(120)
    assert done
    status, _, _ = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                   "temperature": 0.5})
    assert status == 200


def test_disconnect_mid_stream_frees_the_slot(server):
    body = json.dumps({"prompt": "def ", "max_tokens": 500, "temperature": 0.7,
                       "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    received = b""
    while received.count(b"data: ") < 2:  # chunks are flowing: the generation runs
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.0 200")
    sock.close()
    deadline, status = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        status, _, _ = server.post("/v1/completions", {"prompt": "x", "max_tokens": 3,
                                                       "temperature": 0.5})
        if status == 200:
            break
        time.sleep(0.2)  # the generator notices at its next token
    assert status == 200, "the abandoned request still holds the model"


def test_memo_serves_repeated_greedy_requests_only(server):
    c = server.client.with_options(max_retries=0)
    body = dict(model="default_model", prompt="while True:", max_tokens=7, temperature=0)
    first = c.completions.with_raw_response.create(**body)
    second = c.completions.with_raw_response.create(**body)
    assert first.headers[MEMO] == "miss" and second.headers[MEMO] == "hit"
    assert first.parse().choices[0].text == second.parse().choices[0].text
    assert first.parse().id != second.parse().id  # a response of its own
    assert second.parse().id.startswith("cmpl-")
    assert second.parse().created >= first.parse().created
    heads, texts, ids = [], [], []
    for _ in range(2):  # streamed: the memo replays the whole event stream
        raw = c.completions.with_raw_response.create(**body, stream=True)
        heads.append(raw.headers[MEMO])
        chunks = list(raw.parse())
        texts.append("".join(chunk.choices[0].text for chunk in chunks))
        ids.append({chunk.id for chunk in chunks})
    assert heads == ["miss", "hit"] and texts[0] == texts[1] == first.parse().choices[0].text
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1]
    sampled = [c.completions.with_raw_response.create(**dict(body, temperature=0.9))
               for _ in range(2)]
    assert all(MEMO not in s.headers for s in sampled)


def test_models_and_stats(server, models):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    assert [m.id for m in server.client.models.list().data] == [stream_dir.name]
    with urllib.request.urlopen(server.url + "/v1/stats") as r:
        stats = json.loads(r.read())
    assert stats["streaming"]["slots_per_layer"] == 4
    assert stats["streaming"]["total"]["hits"] + stats["streaming"]["total"]["misses"] > 0
    assert stats["recent_requests"] > 0 and stats["recent_tokens_per_s"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--temp", "-1"], "--temp"),
    (["--temp", "1e-38"], "at least 0.001"),  # started, then ran every request greedy
    (["--max-tokens", "0"], "--max-tokens"),
    (["--max-tokens", "100000"], "context"),
    (["--top-p", "nan"], "top_p"),
    (["--top-k", "100000"], "top_k"),
    # The tiny model's head dimension (32) is no multiple of the group size (64).
    (["--kv-bits", "3", "--quantized-kv-start", "0"], "--kv-bits 3 --kv-group-size 64"),
    (["--kv-bits", "7"], "--kv-bits must be one of"),
    # mlx-lm's own size parser raised decimal's error: a traceback.
    (["--prompt-cache-bytes", "junk"], "--prompt-cache-bytes: not a valid value: 'junk'"),
    (["--prompt-cache-size", "-1"], "--prompt-cache-size must be 0 or more"),  # was taken
])
def test_bad_request_defaults_are_refused_at_start(models, flags, message):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    proc = subprocess.run([sys.executable, "-m", "mlx_streaming.server", "--model",
                           str(stream_dir), "--port", str(free_port()), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last


def test_bad_model_dir_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mlx_streaming.server", "--model",
                           str(tmp_path / "nope"), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


def test_read_error_mid_generation_is_a_500_not_a_traceback(models, tmp_path):
    import shutil

    from mlx_streaming.format import read_manifest

    _, stream_dir = models.get("qwen3_moe", quantized=True)
    copy = tmp_path / "stream"
    shutil.copytree(stream_dir, copy)
    s = Server(copy, "--slots-per-layer", "4")
    try:
        for spec in read_manifest(copy).layers:
            os.truncate(copy / "experts" / spec.file, 0)  # the disk goes away
        status, _, reply = s.post("/v1/completions", {"prompt": "def f(x):", "max_tokens": 20})
        assert status in (500, 503), reply
        assert "short read" in reply["error"]["message"]
        with urllib.request.urlopen(s.url + "/health") as r:
            assert r.status == 200
        # The generation thread lived through it: with the disk back, the
        # next requests (decoded together) are served.
        for spec in read_manifest(stream_dir).layers:
            shutil.copy(stream_dir / "experts" / spec.file, copy / "experts" / spec.file)
        assert [st for st, _ in _together(s, ["def f(x):", "import os"], 8)] == [200, 200]
    finally:
        err = s.stop()
    assert "Traceback" not in err and ("request failed" in err or "generation failed" in err)


def test_admission_is_free_once_the_last_token_is_out():
    """The place is given back when the token iterator ends, before mlx-lm
    writes the answer's last bytes: released after the write, a client that
    had its whole answer and asked again raced into a 429 with
    ``--max-queue 0`` (found in CI). The handler's own release after the
    write then gives nothing back twice."""
    from mlx_streaming.server.admission import current_request
    from mlx_streaming.server.service import Service, counting

    class Provider:
        cli_args = type("Args", (), {"model": "/m"})

    service = Service(Provider(), max_queue=0, memo_mb=0)
    ticket = service.admission.enter()
    assert service.admission.enter() is None  # the one place is taken
    current_request.ticket = ticket
    responses = [types.SimpleNamespace(text=t, token=i) for i, t in enumerate("ab")]
    try:
        wrapped = counting(service, lambda request, args, cb: (None, iter(responses)))
        _, tokens = wrapped(None, None)
        assert list(tokens) == responses and current_request.tokens == 2
    finally:
        current_request.ticket = None
    again = service.admission.enter()
    assert again is not None  # free before the handler writes the answer
    ticket.release()  # the handler's release after the write
    assert service.admission.active == 1 and service.admission.enter() is None
    again.release()
    assert service.admission.active == 0


def test_admission_is_free_when_an_error_reply_is_written():
    """mlx-lm's own error replies (status line, then body) give the place
    back as the body goes out, as a finished generation does."""
    import io

    from mlx_streaming.server.admission import Admission, current_request
    from mlx_streaming.server.handler import OutputTap

    admission = Admission(max_queue=0)
    current_request.ticket = ticket = admission.enter()
    current_request.failure = None  # the request's, not a failure of the server
    try:
        out = OutputTap(io.BytesIO(), record=False)
        out.write(b"HTTP/1.0 404 Not Found\r\nContent-Type: application/json\r\n\r\n")
        assert admission.enter() is None  # the status line alone is held
        out.write(b'{"error": "no"}')
        assert b"400 Bad Request" in out.out.getvalue()
        again = admission.enter()
        assert again is not None
    finally:
        current_request.ticket = None
    ticket.release()
    again.release()
    assert admission.active == 0


def test_admission_is_free_before_the_servers_own_error_reply_goes_out():
    """The server's own refusals of an admitted request (a prompt longer
    than the context, a failure) give its place back before their first
    byte."""
    import io
    from types import SimpleNamespace

    from mlx_streaming.server.admission import Admission, current_request
    from mlx_streaming.server.handler import StreamingAPIHandler

    admission = Admission(max_queue=0)
    active = []

    class Out(io.BytesIO):
        def write(self, b):
            active.append(admission.active)
            return super().write(b)

    handler = object.__new__(StreamingAPIHandler)
    handler.wfile, handler.headers = Out(), {}
    handler.request_version, handler.requestline = "HTTP/1.1", "POST /v1/completions HTTP/1.1"
    handler.response_generator = SimpleNamespace(cli_args=SimpleNamespace(allowed_origins=[]))
    current_request.ticket = ticket = admission.enter()
    try:
        handler._error(400, "the prompt is longer than the model's context")
    finally:
        current_request.ticket = None
    assert handler.wfile.getvalue().split(b" ", 2)[1] == b"400"
    assert active and set(active) == {0}
    ticket.release()
    assert admission.active == 0


def test_the_servers_flags_are_mlx_lms():
    """Every flag of mlx-lm's server is ours too (taken from its parser),
    with its default but where ours differs on purpose."""
    from mlx_streaming.mlx_lm_adapter import server_parser
    from mlx_streaming.server.app import setup_arg_parser

    theirs = {a.dest: a.default for a in server_parser()._actions if a.dest != "help"}
    ours = {a.dest: a.default for a in setup_arg_parser()._actions}
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"mlx-lm server flags we do not take: {missing}"
    # Ours on purpose (docs/serving.md): fewer sequences decoded together.
    assert ours["decode_concurrency"] == ours["prompt_concurrency"] == 4
    assert ours["prefill_step_size"] is None  # from the memory plan
    own = {"decode_concurrency", "prompt_concurrency", "prefill_step_size"}
    assert {k: ours[k] for k in theirs if k not in own} == \
        {k: v for k, v in theirs.items() if k not in own}


def test_the_server_exits_cleanly_after_generating_on_its_own_thread(models):
    """mlx-lm's generation thread leaves MLX streams whose teardown could
    abort the interpreter at exit (status 134, "terminate called without an
    active exception"): Ctrl-C after a request ends the server with 0, every
    time (it aborted in 2 of 3 tries before)."""
    import signal

    _, stream_dir = models.get("qwen3_moe", quantized=True)
    for _ in range(3):
        s = Server(stream_dir, "--slots-per-layer", "4")
        assert s.post("/v1/completions", {"prompt": "def f(x):", "max_tokens": 8})[0] == 200
        s.proc.send_signal(signal.SIGINT)
        s.proc.wait(timeout=60)
        s.reader.join(timeout=30)
        err = "".join(s.lines)
        assert s.proc.returncode == 0 and "terminate called" not in err, err


def test_ctrl_c_finishes_the_requests_in_flight(models):
    """Ctrl-C stops taking requests and finishes those in flight, as the
    server says (it exited at once: the stream ended without [DONE])."""
    import http.client
    import signal

    _, stream_dir = models.get("qwen3_moe", quantized=True)
    s = Server(stream_dir, "--slots-per-layer", "4")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps(
            {"prompt": "def f(x):", "max_tokens": 300, "stream": True}),
            {"Content-Type": "application/json"})
        reply = conn.getresponse()
        assert reply.status == 200
        while not reply.readline().startswith(b"data: "):  # past keep-alive comments
            pass
        s.proc.send_signal(signal.SIGINT)
        rest = reply.read().decode()
        s.proc.wait(timeout=120)
        s.reader.join(timeout=30)
        err = "".join(s.lines)
        assert rest.rstrip().endswith("data: [DONE]"), rest[-300:]
        assert "finishing 1 request in flight" in err and s.proc.returncode == 0, err
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


@pytest.mark.parametrize("draft, family", [("ngram", "qwen3_moe"), ("mtp", "deepseek_v3")])
def test_the_server_drafts_losslessly(models, draft, family):
    """``--draft``: greedy answers are the undrafted server's, token for
    token, those of repeated prompts too (served from the kept prompt
    cache, which a drafted generation must leave as mlx-lm's does, also
    when a stop word ends it inside a run of accepted drafts); the
    acceptance shows in /v1/stats; a request with other sampling (top_p)
    is served without drafts."""
    extra = {"num_nextn_predict_layers": 1} if draft == "mtp" else {}
    _, stream_dir = models.get(family, quantized=True, **extra)
    prompts = ["def f(x):\n    return f(x) + f(x)", "import os\nimport os\nimport",
               "class A:\n    pass\nclass"]
    answers = {}
    for flags in ([], ["--draft", draft, "--num-draft-tokens", "3"]):
        s = Server(stream_dir, "--slots-per-layer", "8", *flags)
        try:
            answers[bool(flags)] = [s.client.completions.create(
                model="default_model", prompt=p, max_tokens=16, temperature=0,
                stop=stop).choices[0].text
                for p in prompts * 2 for stop in (None, "x)")]
            spec = json.loads(urllib.request.urlopen(s.url + "/v1/stats").read())[
                "streaming"]["speculative"]
            if flags:
                assert spec["calls"] > 0 and spec["drafted"] > 0, spec
                sampled = s.client.completions.create(
                    model="default_model", prompt=prompts[0], max_tokens=4, temperature=0.7,
                    top_p=0.9)
                assert sampled.choices[0].finish_reason in ("length", "stop")
            else:
                assert spec["calls"] == 0
        finally:
            err = s.stop()
        assert "Traceback" not in err, err
    assert answers[True] == answers[False]



def _together(server, prompts, max_tokens=16):
    """Each prompt's greedy completion, the requests sent at once."""
    out = [None] * len(prompts)

    def one(i):
        status, _, body = server.post("/v1/completions", {
            "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0})
        out[i] = (status, body["choices"][0]["text"] if status == 200 else body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next"])
def test_requests_together_are_decoded_together_as_mlx_lm_does(models, family):
    """Four requests at once are one batch (fewer model calls than tokens),
    and each answer is the one mlx-lm's server gives on the resident model
    for the same requests at once."""
    src, stream_dir = models.get(family, quantized=True)
    prompts = ["def f(x):", "import os", "class A:", "for i in range("]
    answers = {}
    for name, server in (("ours", lambda: Server(stream_dir, "--slots-per-layer", "4")),
                         ("mlx_lm", lambda: Server(src, module="mlx_lm"))):
        s = server()
        try:
            answers[name] = _together(s, prompts)
            if name == "ours":
                total = json.loads(urllib.request.urlopen(s.url + "/v1/stats").read())[
                    "streaming"]["total"]
                assert total["tokens"] > total["calls"], total
        finally:
            err = s.stop()
        assert "Traceback" not in err, err
    assert answers["ours"] == answers["mlx_lm"]


def test_a_flood_of_clients_gets_answers_or_429s(models):
    """30 clients at once against 4 decoded together and 8 waiting: 200s and
    429s only, and the server keeps serving; a streaming client that leaves
    gives its place back."""
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    s = Server(stream_dir, "--slots-per-layer", "4", "--decode-concurrency", "4",
               "--max-queue", "8")
    try:
        statuses = [st for st, _ in _together(s, [f"def f{i}(x):" for i in range(30)], 24)]
        assert set(statuses) <= {200, 429} and statuses.count(200) >= 12, statuses
        stream = s.client.completions.create(model="default_model", prompt="import os",
                                             max_tokens=200, stream=True)
        next(iter(stream))
        stream.close()  # the client leaves mid-answer
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            queue = json.loads(urllib.request.urlopen(s.url + "/v1/stats").read())["queue"]
            if queue["active"] == 0:
                break
            time.sleep(0.2)
        assert queue == {"active": 0, "limit": 12}
        assert s.post("/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    finally:
        err = s.stop()
    assert "Traceback" not in err, err


def test_a_batch_that_cannot_fit_is_refused_at_start(models):
    """The KV caches of the sequences decoded together come out of the
    memory plan: in a 0.5 GB memory cgroup, 256 of them are refused at
    start, naming what to lower."""
    from mlx_streaming.bench.inputs import BenchError
    from mlx_streaming.bench.limits import MemoryLimit

    _, stream_dir = models.get("qwen3_moe", quantized=True)
    try:
        limit = MemoryLimit(0.5)
    except BenchError as e:
        pytest.skip(str(e))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_streaming.server", "--model", str(stream_dir),
             "--decode-concurrency", "256", "--port", str(free_port())],
            capture_output=True, text=True, timeout=120, preexec_fn=limit.enter)
    finally:
        limit.close()
    assert proc.returncode == 1, proc.stderr
    assert "256 KV caches" in proc.stderr and "--decode-concurrency" in proc.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_port_0_prints_the_url_it_is_bound_to(models, host):
    # An IPv6 address is bracketed in the URL (it printed http://::1:PORT).
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    proc = subprocess.Popen([sys.executable, "-m", "mlx_streaming.server", "--model",
                             str(stream_dir), "--host", host, "--port", "0",
                             "--slots-per-layer", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = next(line for line in proc.stderr if "serving" in line)
        url = line.split(" on ")[1].split()[0]
        assert urllib.parse.urlsplit(url).hostname == host, line
        assert urllib.parse.urlsplit(url).port not in (None, 0), line
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_approximate_answers_say_so_and_exact_ones_do_not(server, models):
    header = "X-MLX-Streaming-Approximate"
    body = {"messages": [{"role": "user", "content": "def"}], "max_tokens": 4}
    status, headers, reply = server.post("/v1/chat/completions", body)
    assert status == 200 and header not in headers and "approximate" not in reply
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    s = Server(stream_dir, "--slots-per-layer", "4", "--routing", "cache-aware")
    try:
        status, headers, reply = s.post("/v1/chat/completions", body)
        assert status == 200 and "routing='cache-aware'" in headers[header]
        assert reply["approximate"] == headers[header]
        chunks = list(s.client.chat.completions.create(
            messages=body["messages"], model="default_model", max_tokens=4, stream=True,
            stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None  # the usage chunk says it too
        assert chunks and all(c.model_extra["approximate"] == headers[header] for c in chunks)
        raw = s.client.completions.with_raw_response.create(
            prompt="def", model="default_model", max_tokens=4)
        assert "routing='cache-aware'" in raw.headers[header]
    finally:
        assert "Traceback" not in s.stop()
