"""The OpenAI, Ollama and Anthropic APIs of one server, driven by the real
``openai``, ``ollama`` and ``anthropic`` clients on a tiny model that is
scripted to call a tool: a chat template that ends a prompt offering tools
with ``<|call|>``, and weights that follow ``<|call|>`` with a tool call in
the template's format (special tokens on hidden dimensions of their own)."""

import json
import time
import urllib.request

import anthropic
import mlx.core as mx
import numpy as np
import ollama
import pytest

from mlx_streaming.conversion.local import convert
from mlx_streaming.testing import tiny
from mlx_streaming.testing.helpers import Server, free_port

CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
# Each special token is followed by the next; the last by the end of text.
SCRIPT = ["<|call|>", "<tool_call>", CALL, "</tool_call>"]
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}tool: {{ m.content }}\n"
    "{% else %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
    "{% set tool_call = c.function %}<tool_call>{\"name\": \"{{ tool_call.name }}\", "
    "\"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{% if tools and messages[-1].role == 'user' %}<|call|>{% else %}assistant:{% endif %}"
    "{% endif %}")
TOOLS_OPENAI = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOLS_ANTHROPIC = [{"name": "get_weather", "description": "The weather in a city",
                    "input_schema": TOOLS_OPENAI[0]["function"]["parameters"]}]
HEADER = "X-MLX-Streaming-Approximate"


def scripted_tokenizer(tokenizer_dir, out):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": SCRIPT})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(out))
    return tok


def script_weights(model, tok):
    """Zero every layer's writes into hidden dimensions of the script's
    own, give each script token a large embedding on one of them, and make
    the head read it as the next token of the script."""
    ids = tok.convert_tokens_to_ids(SCRIPT) + [tok.eos_token_id]
    dims = list(range(len(SCRIPT)))
    embed = np.array(model.model.embed_tokens.weight)
    head = np.array(model.lm_head.weight)
    embed[:, dims] = 0
    head[:, dims] = 0
    for dim, (token, following) in enumerate(zip(ids, ids[1:])):
        embed[token] = 0
        embed[token, dim] = 1000.0
        head[following, dim] = 10.0
    model.model.embed_tokens.weight = mx.array(embed)
    model.lm_head.weight = mx.array(head)
    for layer in model.model.layers:
        o = np.array(layer.self_attn.o_proj.weight)
        o[dims] = 0
        layer.self_attn.o_proj.weight = mx.array(o)
        down = np.array(layer.mlp.switch_mlp.down_proj.weight)  # [experts, hidden, inner]
        down[:, dims] = 0
        layer.mlp.switch_mlp.down_proj.weight = mx.array(down)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("tools")
    tok = scripted_tokenizer(tokenizer_dir, root / "tokenizer")
    config = tiny.tiny_config("qwen3_moe", len(tok))
    model = tiny.build_model(config)
    script_weights(model, tok)
    src = tiny.save_mlx_model(model, config, root / "mlx", root / "tokenizer")
    return convert(src, root / "stream", progress=False)


@pytest.fixture(scope="module")
def server(tool_model):
    # Approximate (static) routing: every API must say so. One request at a time and
    # no queue: a second request while one runs is a 429. Small prefill
    # steps: a streamed answer gets keep-alives while its prompt is read.
    ollama_port = free_port()
    s = Server(tool_model, "--slots-per-layer", "4", "--routing", "top-k-cut", "--routing-keep", "2",
               "--decode-concurrency", "1", "--max-queue", "0", "--prefill-step-size", "4",
               "--ollama-port", str(ollama_port))
    s.ollama_port = ollama_port
    s.ollama = ollama.Client(host=s.url)
    s.anthropic = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    s.model = s.client.models.list().data[0].id
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


SYSTEM, QUESTION = "You answer in Python.", "def f(x):"
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def openai_text(s, stream: bool) -> str:
    reply = s.client.chat.completions.create(model=s.model, messages=MESSAGES, max_tokens=8,
                                             temperature=0, stream=stream)
    if not stream:
        return reply.choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)


def ollama_text(s, stream: bool) -> str:
    options = {"temperature": 0, "num_predict": 8}
    reply = s.ollama.chat(model=s.model, messages=MESSAGES, options=options, stream=stream)
    if not stream:
        return reply.message.content
    return "".join(part.message.content for part in reply)


def ollama_generate_text(s, stream: bool) -> str:
    options = {"temperature": 0, "num_predict": 8}
    reply = s.ollama.generate(model=s.model, system=SYSTEM, prompt=QUESTION, options=options,
                              stream=stream)
    return "".join(part.response for part in reply) if stream else reply.response


def anthropic_text(s, stream: bool) -> str:
    # The SDK leaves sampling out of its arguments; the API takes it.
    request = dict(model=s.model, system=SYSTEM, max_tokens=8, extra_body={"temperature": 0},
                   messages=[{"role": "user", "content": QUESTION}])
    if not stream:
        return "".join(b.text for b in s.anthropic.messages.create(**request).content)
    with s.anthropic.messages.stream(**request) as events:
        return "".join(events.text_stream)


@pytest.mark.parametrize("stream", [False, True])
def test_the_same_chat_gives_the_same_text_through_every_api(server, stream):
    texts = {f.__name__: f(server, stream) for f in (openai_text, ollama_text,
                                                       ollama_generate_text, anthropic_text)}
    assert texts["openai_text"] and "<|call|>" not in texts["openai_text"], texts
    assert len(set(texts.values())) == 1, texts


def test_an_ollama_model_list_names_the_model(server):
    assert [m.model for m in server.ollama.list().models] == [server.model]
    assert server.ollama.show(server.model + ":latest").capabilities == ["completion", "tools"]
    assert server.ollama.ps().models[0].context_length == 1024
    assert server.ollama.chat(model=server.model, messages=[]).done_reason == "load"
    with urllib.request.urlopen(server.url + "/api/version") as r:
        assert json.loads(r.read())["version"]


def test_the_ollama_port_serves_the_same_model(server):
    other = ollama.Client(host=f"http://127.0.0.1:{server.ollama_port}")
    assert [m.model for m in other.list().models] == [server.model]
    reply = other.chat(model=server.model, messages=MESSAGES,
                       options={"temperature": 0, "num_predict": 8})
    assert reply.message.content == openai_text(server, False)


def test_openai_tool_call_round_trip(server):
    c = server.client
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = c.chat.completions.create(model=server.model, messages=messages, tools=TOOLS_OPENAI,
                                      max_tokens=16, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    streamed = [ch for ch in c.chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS_OPENAI, max_tokens=16,
        temperature=0, stream=True) if ch.choices and ch.choices[0].delta.tool_calls]
    assert streamed[0].choices[0].delta.tool_calls[0].function.name == "get_weather"
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = c.chat.completions.create(model=server.model, messages=messages,
                                       tools=TOOLS_OPENAI, max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens


def test_ollama_tool_call_round_trip(server):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = server.ollama.chat(model=server.model, messages=messages, tools=TOOLS_OPENAI,
                               options={"temperature": 0, "num_predict": 16})
    call = reply.message.tool_calls[0].function
    assert (call.name, dict(call.arguments)) == ("get_weather", {"city": "Paris"})
    parts = list(server.ollama.chat(model=server.model, messages=messages, tools=TOOLS_OPENAI,
                                    options={"temperature": 0}, stream=True))
    assert [p.message.tool_calls[0].function.name for p in parts if p.message.tool_calls] == \
        ["get_weather"] and parts[-1].done
    messages += [reply.message.model_dump(exclude_none=True),
                 {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    answer = server.ollama.chat(model=server.model, messages=messages, tools=TOOLS_OPENAI,
                                options={"temperature": 0, "num_predict": 4})
    assert answer.message.content and not answer.message.tool_calls
    assert answer.done_reason == "length" and answer.prompt_eval_count > reply.prompt_eval_count


def test_anthropic_tool_use_round_trip(server):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    request = dict(model=server.model, max_tokens=16, tools=TOOLS_ANTHROPIC,
                   extra_body={"temperature": 0})
    reply = server.anthropic.messages.create(messages=messages, **request)
    assert reply.stop_reason == "tool_use", reply
    use = reply.content[-1]
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    with server.anthropic.messages.stream(messages=messages, **request) as events:
        streamed = events.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == use.input
    messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "sunny"}]}]
    answer = server.anthropic.messages.create(messages=messages, **dict(request, max_tokens=4))
    assert answer.stop_reason == "max_tokens" and answer.content[0].text
    assert answer.usage.cache_read_input_tokens > 0  # the first turn's prompt, cached


def test_anthropic_stream_follows_the_documented_event_sequence(server):
    body = {"model": server.model, "max_tokens": 5, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}]}
    req = urllib.request.Request(server.url + "/v1/messages", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    # Keep-alives while the prompt was read: SSE comments until message_start.
    assert names[0].startswith(": keepalive")
    names = [n for n in names if n != "ping" and not n.startswith(":")]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    delta = json.loads(events[-2].split("data: ", 1)[1])
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 5


def test_anthropic_says_which_stop_sequence_ended_the_answer(server, tool_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tool_model))
    messages = [{"role": "user", "content": QUESTION}]
    reply = server.client.chat.completions.create(model=server.model, messages=messages,
                                                  max_tokens=8, temperature=0, logprobs=True)
    ids = [t.model_extra["id"] for t in reply.choices[0].logprobs.content]
    # A token of the answer that is a stop sequence of its own.
    stop = next(tok.decode([i]) for i in ids[1:] if tok.encode(tok.decode([i])) == [i])
    request = dict(model=server.model, max_tokens=8, messages=messages, stop_sequences=[stop],
                   extra_body={"temperature": 0})
    with server.anthropic.messages.stream(**request) as events:
        streamed = events.get_final_message()
    for message in (server.anthropic.messages.create(**request), streamed):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    unstopped = server.anthropic.messages.create(**dict(request, stop_sequences=["\x01"]))
    assert unstopped.stop_reason != "stop_sequence" and unstopped.stop_sequence is None


def test_count_tokens_counts_the_prompt_of_a_message(server):
    request = dict(model=server.model, system=SYSTEM,
                   messages=[{"role": "user", "content": "count me " * 7}])
    counted = server.anthropic.messages.count_tokens(**request).input_tokens
    usage = server.anthropic.messages.create(max_tokens=1, **request).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens > 7


def test_approximate_answers_say_so_in_every_api(server):
    body = {"model": server.model, "max_tokens": 3,
            "messages": [{"role": "user", "content": QUESTION}]}
    for path, stream in (("/api/chat", False), ("/v1/messages", False)):
        status, headers, reply = server.post(path, dict(body, stream=stream))
        assert status == 200 and "top-k-cut" in headers[HEADER]
        assert reply["approximate"] == headers[HEADER]
    req = urllib.request.Request(server.url + "/api/chat", json.dumps(body).encode())
    with urllib.request.urlopen(req) as r:
        lines = [json.loads(line) for line in r.read().splitlines()]
        assert "top-k-cut" in r.headers[HEADER]
    assert lines[-1]["done"] and all(line["approximate"] == r.headers[HEADER] for line in lines)


@pytest.mark.parametrize("path, body, status", [
    ("/api/chat", {"messages": []}, 400),  # no model
    ("/api/chat", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/api/chat", {"model": "M", "messages": "hi"}, 400),
    ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                   "options": {"num_predict": 100000}}, 400),
    ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                   "options": {"temperature": "hot"}}, 400),
    ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "x"}],
                   "options": {"num_ctx": 100000}}, 400),
    ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "x " * 50}],
                   "options": {"num_ctx": 20, "num_predict": 4}}, 400),
    ("/api/chat", {"model": "M", "messages": [{"role": "user", "content": "x " * 50}],
                   "options": {"num_ctx": 20}}, 400),  # no room left at all
    ("/api/generate", {"model": "M", "prompt": 5}, 400),
    ("/api/chat", None, 400),  # not JSON
    ("/api/pull", {"model": "M"}, 404),
    ("/v1/messages", {"model": "M", "messages": [{"role": "user", "content": "x"}]}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": 5}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": "5", "messages": [
        {"role": "user", "content": "x"}]}, 400),
    ("/v1/messages", {"model": "claude-x", "max_tokens": 5, "messages": [
        {"role": "user", "content": "x"}]}, 404),
    ("/v1/messages", {"model": "M", "max_tokens": 100000, "messages": [
        {"role": "user", "content": "x"}]}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": 5, "temperature": -1, "messages": [
        {"role": "user", "content": "x"}]}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400),
    ("/v1/messages", None, 400),
    # Refused by mlx-lm itself (its reply has no length): still Anthropic's shape.
    ("/v1/messages", {"model": "M", "max_tokens": 5, "stream": "yes", "messages": [
        {"role": "user", "content": "x"}]}, 400),
    ("/v1/messages/count_tokens", {"model": "M"}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": None, "messages": [
        {"role": "user", "content": "x"}]}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": 5, "tools": {}, "messages": [
        {"role": "user", "content": "x"}]}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": 5, "tools": [
        {"name": "f", "input_schema": "object"}], "messages": [
        {"role": "user", "content": "x"}]}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": 5, "messages": [
        {"role": "user", "content": []}]}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, 400),
    ("/v1/messages", {"model": "M", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "x"}]}]}, 400),
])
def test_bad_requests_get_errors_in_their_apis_shape(server, path, body, status):
    if body is not None and body.get("model") == "M":
        body = dict(body, model=server.model)
    raw = b"{not json" if body is None else None
    got, _, reply = server.post(path, body, raw)
    assert got == status, reply
    if path.startswith("/api/"):
        assert set(reply) == {"error"} and isinstance(reply["error"], str)
        message = reply["error"]
    else:
        assert reply["type"] == "error" and reply["error"]["type"] == (
            "not_found_error" if status == 404 else "invalid_request_error")
        message = reply["error"]["message"]
    assert message and "Traceback" not in message


def test_the_clients_raise_their_own_errors(server):
    with pytest.raises(anthropic.NotFoundError):
        server.anthropic.messages.create(model="claude-x", max_tokens=4,
                                         messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        server.anthropic.messages.create(model=server.model, max_tokens=5000,
                                         messages=[{"role": "user", "content": "x"}])
    with pytest.raises(ollama.ResponseError) as e:
        server.ollama.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 404


def test_a_busy_server_answers_429_in_every_api(server, tool_model):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(str(tool_model)).eos_token_id
    # A request that holds the one place until its client leaves.
    stream = server.client.completions.create(
        model=server.model, prompt="def ", max_tokens=1000, temperature=0.7, stream=True,
        logit_bias={str(eos): -100})
    next(iter(stream))
    chat = {"model": server.model, "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2}
    try:
        for path in ("/api/chat", "/v1/messages"):
            status, headers, reply = server.post(path, chat)
            assert status == 429 and headers.get("Retry-After") == "1", (path, reply)
            assert reply.get("error") if path.startswith("/api/") else \
                reply["error"]["type"] == "rate_limit_error"
        # Counting generates nothing: it takes no place.
        status, _, reply = server.post("/v1/messages/count_tokens", chat)
        assert status == 200 and reply["input_tokens"] > 0
    finally:
        stream.close()
    deadline = time.monotonic() + 30
    while server.post("/api/chat", dict(chat, stream=False))[0] == 429:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_bench_clients_speak_every_api(server):
    from mlx_streaming.bench.clients import APIS, streamed

    raw = {api: streamed(server.url, api, 4, prompt=QUESTION) for api in ("openai", "ollama")}
    chats = {api: streamed(server.url, api, 4, messages=MESSAGES) for api in APIS}
    for r in [*raw.values(), *chats.values()]:
        assert r["tokens"] == 4 and r["ttft"] is not None, r
    assert raw["openai"]["text"] == raw["ollama"]["text"]
    assert len({r["text"] for r in chats.values()}) == 1


def _greedy(s, tool_model, max_tokens=8):
    """The greedy answer to QUESTION, and its tokens' texts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tool_model))
    reply = s.client.chat.completions.create(
        model=s.model, messages=[{"role": "user", "content": QUESTION}],
        max_tokens=max_tokens, temperature=0, logprobs=True)
    return reply.choices[0].message.content, [
        tok.decode([t.model_extra["id"]]) for t in reply.choices[0].logprobs.content]


def _stopped(s, api, stop, stream):
    """``(text, finish)`` of the greedy answer to QUESTION with ``stop``."""
    messages = [{"role": "user", "content": QUESTION}]
    if api == "openai":
        reply = s.client.chat.completions.create(model=s.model, messages=messages,
                                                 max_tokens=8, temperature=0, stop=[stop],
                                                 stream=stream)
        if not stream:
            return reply.choices[0].message.content, reply.choices[0].finish_reason
        chunks = [c for c in reply if c.choices]
        return ("".join(c.choices[0].delta.content or "" for c in chunks),
                chunks[-1].choices[0].finish_reason)
    if api == "ollama":
        options = {"temperature": 0, "num_predict": 8, "stop": [stop]}
        reply = s.ollama.chat(model=s.model, messages=messages, options=options, stream=stream)
        parts = list(reply) if stream else [reply]
        return "".join(p.message.content for p in parts), parts[-1].done_reason
    request = dict(model=s.model, max_tokens=8, messages=messages, stop_sequences=[stop],
                   extra_body={"temperature": 0})
    if stream:
        with s.anthropic.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = s.anthropic.messages.create(**request)
    assert message.stop_sequence == (stop if message.stop_reason == "stop_sequence" else None)
    return "".join(b.text for b in message.content), message.stop_reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_answer_at_its_first_occurrence(server, tool_model, stream):
    text, tokens = _greedy(server, tool_model)
    # A stop string across two tokens, and one character (the first that recurs).
    across = next(a + b for a, b in zip(tokens, tokens[1:]) if a and b and text.find(a + b) > 0)
    single = max((c for c in text if text.find(c) > 0), key=text.count)
    for stop in (across, single):
        expected = text[:text.find(stop)]
        for api, finish in (("openai", "stop"), ("ollama", "stop"),
                            ("anthropic", "stop_sequence")):
            assert _stopped(server, api, stop, stream) == (expected, finish), (api, stop, text)
    absent = "\x01"  # never generated: the whole answer, none of it cut
    assert _stopped(server, "openai", absent, stream)[0] == text


def test_an_anthropic_assistant_prefill_is_continued(server):
    prefill = "000"
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": prefill}]
    reply = server.anthropic.messages.create(model=server.model, max_tokens=6, messages=messages,
                                             extra_body={"temperature": 0})
    # The template's text of the chat (its newlines trimmed), ending with the prefill.
    continued = server.client.completions.create(
        model=server.model, prompt=f"user: {QUESTION}assistant: {prefill}", max_tokens=6,
        temperature=0)
    assert reply.content[0].text == continued.choices[0].text
    assert reply.usage.output_tokens == 6


def test_a_whole_ollama_answer_splits_its_time_between_prompt_and_answer(server):
    reply = server.ollama.chat(model=server.model, messages=MESSAGES,
                               options={"temperature": 0, "num_predict": 8})
    assert reply.eval_count == 8 and reply.eval_duration > 0
    assert 0 < reply.prompt_eval_duration < reply.total_duration
    assert reply.prompt_eval_duration + reply.eval_duration <= reply.total_duration


def _raw(s, method, path, body=None, headers=None):
    """``(status, content type, body bytes)`` of one request, as sent."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


def test_ollama_liveness_and_head_requests_answer_as_ollama(server):
    assert _raw(server, "GET", "/") == (200, "text/plain; charset=utf-8", b"Ollama is running")
    assert _raw(server, "HEAD", "/") == (200, "text/plain; charset=utf-8", b"")
    for path in ("/api/tags", "/api/version", "/api/ps/"):
        status, kind, body = _raw(server, "HEAD", path)
        assert (status, kind, body) == (200, "application/json", b""), path
    status, kind, body = _raw(server, "DELETE", "/api/delete", b'{"model": "x"}')
    assert status == 404 and kind == "application/json" and json.loads(body)["error"]


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/api/tags", 405), ("GET", "/api/chat", 405), ("GET", "/api/nothing", 404),
    ("PUT", "/api/chat", 405), ("GET", "/v1/messages", 405),
    ("POST", "/v1/messages/nothing", 404), ("DELETE", "/v1/messages", 405),
])
def test_unknown_paths_and_methods_get_their_apis_json_error(server, method, path, status):
    got, kind, body = _raw(server, method, path, b"{}" if method != "GET" else None)
    assert (got, kind) == (status, "application/json"), body
    reply = json.loads(body)
    if path.startswith("/api/"):
        assert set(reply) == {"error"} and reply["error"]
    else:
        assert reply["type"] == "error" and reply["error"]["type"] == (
            "not_found_error" if status == 404 else "invalid_request_error")


def test_a_trailing_slash_names_the_same_endpoint(server):
    body = {"model": server.model, "messages": MESSAGES, "stream": False,
            "options": {"temperature": 0, "num_predict": 4}}
    status, _, reply = server.post("/api/chat/", body)
    assert status == 200 and reply["message"]["content"] == \
        server.post("/api/chat", body)[2]["message"]["content"]


def test_an_anthropic_chunked_body_is_an_invalid_request(server):
    status, _, body = _raw(server, "POST", "/v1/messages", iter([b"{}"]),
                           {"Content-Type": "application/json"})  # chunked: no length
    assert status == 411 and json.loads(body)["error"]["type"] == "invalid_request_error"


def test_anthropic_stream_usage_agrees_from_start_to_end(server):
    body = {"model": server.model, "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "the same prompt, twice " * 3}]}
    for _ in range(2):  # the second one found in the prompt cache
        req = urllib.request.Request(server.url + "/v1/messages", json.dumps(body).encode())
        with urllib.request.urlopen(req) as r:
            events = [json.loads(e.split("data: ", 1)[1])
                      for e in r.read().decode().split("\n\n") if "data: " in e]
        start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
        end = next(e for e in events if e["type"] == "message_delta")["usage"]
        for name in ("input_tokens", "cache_read_input_tokens"):
            assert start[name] == end[name], (start, end)
    assert end["cache_read_input_tokens"] > 0


@pytest.fixture(scope="module")
def memo_server(tool_model):
    s = Server(tool_model, "--slots-per-layer", "4", "--memo-mb", "4")
    s.anthropic = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0)
    s.model = s.client.models.list().data[0].id
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def _events(s, body):
    req = urllib.request.Request(s.url + "/v1/messages", json.dumps(body).encode())
    with urllib.request.urlopen(req) as r:
        return r.headers.get("X-MLX-Streaming-Memo"), [
            json.loads(e.split("data: ", 1)[1]) for e in r.read().decode().split("\n\n")
            if "data: " in e]


def test_a_memo_hit_answers_as_a_miss_did(memo_server, tool_model):
    s = memo_server
    stop = _greedy(s, tool_model)[0][-2:]  # ends the answer, where it first occurs
    question = [{"role": "user", "content": QUESTION}]
    body = {"model": s.model, "max_tokens": 8, "temperature": 0, "messages": question,
            "stop_sequences": [stop], "stream": True}
    (miss, first), (hit, again) = _events(s, body), _events(s, body)
    assert (miss, hit) == ("miss", "hit")
    for events in (first, again):
        delta = next(e for e in events if e["type"] == "message_delta")
        assert (delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]) == \
            ("stop_sequence", stop)
    usage = [next(e for e in events if e["type"] == "message_start")["message"]["usage"]
             for events in (first, again)]
    assert usage[0] == usage[1] and usage[0]["input_tokens"] > 0
    # Tool calls: a new id in each answer, in both APIs.
    weather = [{"role": "user", "content": "Weather in Paris?"}]
    calls = [s.anthropic.messages.create(model=s.model, max_tokens=16, messages=weather,
                                         tools=TOOLS_ANTHROPIC, extra_body={"temperature": 0})
             for _ in range(2)]
    assert calls[0].content[-1].id != calls[1].content[-1].id
    calls = [s.client.chat.completions.create(model=s.model, messages=weather,
                                              tools=TOOLS_OPENAI, max_tokens=16, temperature=0)
             for _ in range(2)]
    ids = [c.choices[0].message.tool_calls[0].id for c in calls]
    assert ids[0] != ids[1] and len(ids[0]) == len(ids[1])


def test_ollama_takes_its_own_option_values(server):
    options = {"temperature": 0, "num_predict": 5.0, "num_ctx": 512.0, "repeat_last_n": -1,
               "repeat_penalty": 1.1, "seed": -1, "typical_p": 1.0, "tfs_z": 1.0}
    reply = server.ollama.chat(model=server.model, messages=MESSAGES, options=options)
    assert reply.eval_count == 5
    body = {"model": server.model, "messages": MESSAGES, "stream": False}
    for bad, named in (({"typical_p": 0.5}, "typical_p"), ({"tfs_z": 2}, "tfs_z"),
                       ({"num_predict": 100000}, "num_predict"),
                       ({"repeat_last_n": -5, "repeat_penalty": 1.1}, "repeat_last_n")):
        status, _, reply = server.post("/api/chat", dict(body, options=bad))
        assert status == 400 and named in reply["error"], reply
        assert not any(n in reply["error"] for n in ("max_tokens", "repetition_")), reply


def test_ollama_keep_alive_unloads_or_is_refused(server):
    for keep_alive in (0, "0", "0s"):
        assert server.ollama.generate(model=server.model,
                                      keep_alive=keep_alive).done_reason == "unload"
    assert server.ollama.chat(model=server.model, messages=[],
                              keep_alive="5m").done_reason == "load"
    for path, body in (("/api/generate", {}), ("/api/chat", {"messages": MESSAGES})):
        status, _, reply = server.post(path, dict(body, model=server.model, keep_alive="banana"))
        assert status == 400 and "keep_alive" in reply["error"]


def test_anthropic_streams_a_tool_calls_fragments_in_one_block():
    from mlx_streaming.server.anthropic import MessagesRenderer

    def call(index, arguments, **first):
        return {"index": index, "function": dict(first, arguments=arguments)}

    renderer = MessagesRenderer("m")
    deltas = [[dict(call(0, '{"ci', name="get_weather"), id="call_1")],
              [call(0, 'ty": "Paris"}')],
              [dict(call(1, '{}', name="get_time"), id="call_2")]]
    out = b"".join(renderer.chunk({"choices": [{"delta": {"tool_calls": d}}]}) for d in deltas)
    out += renderer.chunk({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    out += renderer.end()
    events = [json.loads(e.split("data: ", 1)[1]) for e in out.decode().split("\n\n") if e]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [s["name"] for s in starts] == ["get_weather", "get_time"]
    arguments = ["".join(e["delta"]["partial_json"] for e in events
                         if e["type"] == "content_block_delta" and e["index"] == i)
                 for i in range(2)]
    assert [json.loads(a) for a in arguments] == [{"city": "Paris"}, {}]
    assert [e["type"] for e in events].count("content_block_stop") == 2


def test_ollama_without_num_predict_generates_what_the_context_leaves(server):
    prompt = server.ollama.chat(model=server.model, messages=MESSAGES,
                                options={"num_predict": 1}).prompt_eval_count
    # The server's --max-tokens default is more than num_ctx leaves: cut, not refused.
    reply = server.ollama.chat(model=server.model, messages=MESSAGES,
                               options={"temperature": 0, "num_ctx": prompt + 3})
    assert reply.eval_count <= 3 and reply.done


def test_stop_at_agrees_with_a_search_of_the_whole_text():
    """However the text is cut into tokens, what goes out is the text up to
    the first stop string complete (a plain search of the whole text), and a token
    that ends the text (mlx-lm drops its text) loses nothing held back."""
    import dataclasses
    import random

    from mlx_streaming.server.stops import stop_at

    @dataclasses.dataclass
    class Item:  # mlx-lm's Response, as much of it as stop_at reads
        text: str
        finish_reason: object = None

    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, len(text))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        if rng.random() < 0.5:
            items = [Item(p) for p in pieces] + [Item("", "stop")]  # the end of text
        else:  # max_tokens reached on the last piece
            items = [Item(p) for p in pieces[:-1]] + [Item(pieces[-1], "length")]
        said = []
        out = [i for i in stop_at(iter(items), stops, said.append)]
        kept = "".join(i.text for i in out if i.finish_reason != "stop")
        # The first stop string complete as the text is read a character at a time.
        found = sorted((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)
        assert kept == (text[:found[0][1]] if found else text), (text, stops, pieces)
        assert said == ([found[0][2]] if found else [])
