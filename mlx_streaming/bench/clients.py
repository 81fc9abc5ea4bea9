"""Streamed requests through each API the server speaks (OpenAI, Ollama,
Anthropic), timed the same way: time to first token, the gaps between
tokens, the token count and the text. Plain HTTP, so that the bench needs
no client library beyond OpenAI's.
"""

import json
import time
import urllib.request
from typing import Iterator, List, Optional

import numpy as np

APIS = ("openai", "ollama", "anthropic")


def _lines(url: str, body: dict) -> Iterator[str]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            yield line.decode().strip()


def _openai(base: str, prompt: Optional[str], messages: Optional[list], max_tokens: int):
    """``(text, tokens)`` pieces of an OpenAI stream (chat or completions)."""
    body = dict(max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
    path = "/v1/completions" if prompt is not None else "/v1/chat/completions"
    body.update({"prompt": prompt} if prompt is not None else {"messages": messages})
    for line in _lines(base + path, body):
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: "):])
        if chunk.get("usage"):
            yield "", chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or []:
            yield choice.get("text") or (choice.get("delta") or {}).get("content") or "", None


def _ollama(base: str, prompt: Optional[str], messages: Optional[list], max_tokens: int):
    body = dict(model="default_model", stream=True,
                options={"temperature": 0, "num_predict": max_tokens})
    if prompt is not None:  # raw: the prompt as it is, as OpenAI's completions take it
        path, body = "/api/generate", dict(body, prompt=prompt, raw=True)
    else:
        path, body = "/api/chat", dict(body, messages=messages)
    for line in _lines(base + path, body):
        part = json.loads(line)
        if "error" in part:
            raise RuntimeError(part["error"])
        text = part.get("response") or (part.get("message") or {}).get("content") or ""
        yield text, part.get("eval_count") if part.get("done") else None


def _anthropic(base: str, prompt: Optional[str], messages: Optional[list], max_tokens: int):
    if messages is None:  # the Messages API has no raw prompt: one user turn
        messages = [{"role": "user", "content": prompt}]
    system = [m["content"] for m in messages if m["role"] == "system"]
    body = dict(model="default_model", max_tokens=max_tokens, temperature=0, stream=True,
                messages=[m for m in messages if m["role"] != "system"],
                **({"system": system[0]} if system else {}))
    for line in _lines(base + "/v1/messages", body):
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: "):])
        if event["type"] == "content_block_delta":
            yield event["delta"].get("text", ""), None
        elif event["type"] == "message_delta":
            yield "", event["usage"]["output_tokens"]
        elif event["type"] == "error":
            raise RuntimeError(event["error"]["message"])


STREAMS = {"openai": _openai, "ollama": _ollama, "anthropic": _anthropic}


def streamed(url: str, api: str, max_tokens: int, prompt: Optional[str] = None,
             messages: Optional[List[dict]] = None) -> dict:
    """One streamed, greedy request through ``api``: a completion of
    ``prompt`` (as it is), or a chat of ``messages``. Returns its latency,
    time to first token, gaps between tokens, token count and text."""
    start = time.perf_counter()
    stamps, tokens, text = [], 0, []
    for piece, count in STREAMS[api](url, prompt, messages, max_tokens):
        if count is not None:
            tokens = count
        if piece:
            stamps.append(time.perf_counter())
            text.append(piece)
    return dict(latency=time.perf_counter() - start,
                ttft=stamps[0] - start if stamps else None,
                gaps=list(np.diff(stamps)), tokens=tokens, text="".join(text))
