"""Request fields checked before mlx-lm sees them: OpenAI-style 400s for
what mlx-lm would accept and then fail on, or hold the queue for.
"""

import json
from typing import Optional

from ..flags import MAX_NUM_DRAFT

# mlx-lm builds and keeps a matcher per set of stop strings, ~4 KB per
# character: long ones are memory a request could pin.
MAX_STOP_CHARS = 512


IMAGE_PART_TYPES = ("image_url", "input_image", "image")


# The largest magnitude a number field may have (float32 holds ~3.4e38).
MAX_NUMBER = 1e30


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite number MLX can take as a float32 (JSON integers have no
    bound)."""
    return (is_int(v) or isinstance(v, float)) and abs(v) <= MAX_NUMBER


def _has_image(message: dict) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES for part in content)


# Sampling fields: (lowest, highest) allowed, None for no bound; NaN
# poisons the logits.
_SAMPLING = {
    "top_p": (0, 1), "min_p": (0, 1), "xtc_probability": (0, 1), "xtc_threshold": (0, 1),
    "repetition_penalty": (0, None), "presence_penalty": (None, None),
    "frequency_penalty": (None, None),
}


def check_sampling(body: dict, vocab: Optional[int], temperature: float):
    """As mlx-lm's checks, plus what its samplers raise on where they run
    (at a temperature above 0): a top_k of the vocabulary or more, XTC with
    a threshold above 0.5. Raised inside a sampler compiled with the random
    state, these left the state without a value: every later sampled
    request failed."""
    for name, (low, high) in _SAMPLING.items():
        value = body.get(name)
        if value is None:
            continue
        if not is_number(value) or (low is not None and value < low) or (
                high is not None and value > high):
            bounds = {(0, 1): " from 0 to 1", (0, None): " of 0 or more"}.get((low, high), "")
            return name, f"'{name}' must be a finite number{bounds}, got {value!r}"
    top_k = body.get("top_k")
    if top_k is not None and not (is_int(top_k) and top_k >= 0):
        return "top_k", f"'top_k' must be an integer of 0 (off) or more, got {top_k!r}"
    if temperature > 0 and vocab and (top_k or 0) >= vocab:
        return "top_k", f"'top_k' must be below the vocabulary of {vocab}, got {top_k!r}"
    if temperature > 0 and (body.get("xtc_probability") or 0) > 0 and \
            body.get("xtc_threshold", 0.1) > 0.5:
        return "xtc_threshold", "'xtc_threshold' must be at most 0.5 where XTC applies"
    return None


def check_fields(body: dict, completion: bool, vocab: Optional[int], temperature: float,
                  images: bool = False):
    """The first problem with the request's fields as ``(field, message)``,
    or None. Checked here because mlx-lm lets some through to a crash, or to
    work that holds the queue. ``temperature``: the request's, or the
    server's default; ``images``: the model takes image parts."""
    problem = check_shape(body, completion)
    if problem is not None:
        return problem
    if completion:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) and prompt):
            # mlx-lm encodes the prompt as text: a list of token ids cannot run.
            return "prompt", "'prompt' must be a non-empty string (lists, of strings or " \
                             "token ids, are not supported)"
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return "messages", "'messages' must be a non-empty list of objects with a 'role'"
        problem = _check_messages(messages)
        if problem is not None:
            return "messages", problem
        if not images and any(_has_image(m) for m in messages):
            # mlx-lm would download the image (from any URL) for nothing.
            return "messages", "this model takes text only: remove the image parts"
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and len(stop) <= 16 and all(isinstance(x, str) for x in stop)):
        return "stop", "'stop' must be a string or a list of at most 16 strings"
    stops = [stop] if isinstance(stop, str) else stop or []
    if sum(len(x) for x in stops) > MAX_STOP_CHARS:
        return "stop", f"'stop' strings may hold {MAX_STOP_CHARS} characters in all"
    problem = check_sampling(body, vocab, temperature)
    if problem is not None:
        return problem
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(
                isinstance(k, str) and k.lstrip("-").isdigit() and is_number(v)
                for k, v in bias.items()):
            return "logit_bias", "'logit_bias' must map token ids to numbers"
        if vocab and not all(0 <= int(k) < vocab for k in bias):
            return "logit_bias", f"'logit_bias' token ids must be from 0 to {vocab - 1}"
    seed = body.get("seed")
    if seed is not None and not (is_int(seed) and 0 <= seed < 2**63):
        return "seed", "'seed' must be an integer from 0 to 2**63 - 1"
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(
            options.get("include_usage", False), bool)):
        return "stream_options", "'stream_options' must be an object like {\"include_usage\": true}"
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        value = body.get(name)
        if value is not None and not (is_int(value) and 0 <= value <= 1 << 20):
            return name, f"'{name}' must be an integer from 0 to {1 << 20}"
    return None


# Keywords of apply_chat_template that mlx-lm sets itself, or that change
# what it returns: a request setting them made it fail with a Python error.
RESERVED_TEMPLATE_KEYS = ("tokenize", "tools", "add_generation_prompt", "conversation",
                          "messages", "return_tensors", "return_dict", "padding",
                          "truncation", "max_length", "return_assistant_tokens_mask",
                          "tokenizer_kwargs", "continue_final_message")
# OpenAI's completions take logprobs up to 5; mlx-lm returns up to 10.
MAX_LOGPROBS = 10


def check_shape(body: dict, completion: bool):
    """Fields mlx-lm would pass on unchecked into a Python error (its text
    then the reply), and OpenAI fields this server does not serve, as
    ``(field, message)``; None when there are none."""
    k = body.get("num_draft_tokens")
    if k is not None and not (is_int(k) and 0 <= k <= MAX_NUM_DRAFT):
        return "num_draft_tokens", f"'num_draft_tokens' must be an integer from 0 to {MAX_NUM_DRAFT}"
    for name in ("n", "best_of"):
        if body.get(name, 1) != 1:
            return name, f"'{name}' must be 1: this server returns one choice per request"
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        return "tools", "'tools' must be a list of objects"
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
            return "chat_template_kwargs", "'chat_template_kwargs' must be an object"
        taken = [k for k in RESERVED_TEMPLATE_KEYS if k in kwargs]
        if taken:
            return "chat_template_kwargs", (f"'chat_template_kwargs' may not set {taken[0]!r}, "
                                            "which the server sets itself")
        template = kwargs.get("chat_template", "x")
        if not (isinstance(template, str) and template.strip()):
            return "chat_template_kwargs", "'chat_template' must be a non-empty string"
        documents = kwargs.get("documents", [])
        if not (isinstance(documents, list) and all(isinstance(d, dict) for d in documents)):
            return "chat_template_kwargs", "'documents' must be a list of objects"
    mapping = body.get("role_mapping")
    if mapping is not None and not (isinstance(mapping, dict) and all(
            isinstance(v, str) for v in mapping.values())):
        return "role_mapping", "'role_mapping' must be an object of strings"
    problem = _check_logprobs(body, completion)
    if problem is not None:
        return problem
    where = _not_unicode(body)
    if where is not None:
        return where, f"'{where}' holds text that is not valid Unicode (a lone surrogate)"
    return None


def _check_messages(messages: list):
    """The first problem with the messages' content and tool calls (which
    mlx-lm reshapes before the chat template), or None."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content):
                return "a message's 'content' parts must be objects with a 'type'"
            if any(p["type"] == "text" and not isinstance(p.get("text"), str) for p in content):
                return "a 'text' part of a message's 'content' must have a string 'text'"
        elif content is not None and not isinstance(content, str):
            return "a message's 'content' must be a string, a list of parts or null"
        calls = m.get("tool_calls")
        if calls is None:
            continue
        if not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            return "a message's 'tool_calls' must be a list of objects"
        for call in calls:
            problem = _check_function(call.get("function"))
            if problem is not None:
                return problem
    return None


def _check_function(function):
    if function is None:
        return None
    if not (isinstance(function, dict) and isinstance(function.get("name", ""), str)):
        return "a tool call's 'function' must be an object with a string 'name'"
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return "a tool call's 'arguments' must be JSON"
    if arguments not in (None, "") and not isinstance(arguments, dict):
        return "a tool call's 'arguments' must be a JSON object"
    return None


def _check_logprobs(body: dict, completion: bool):
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if completion and is_int(logprobs):
        # OpenAI's completions API takes the number of top tokens here.
        if not 0 <= logprobs <= MAX_LOGPROBS:
            return "logprobs", f"'logprobs' must be an integer from 0 to {MAX_LOGPROBS}"
    elif logprobs is not None and not isinstance(logprobs, bool):
        return "logprobs", ("'logprobs' must be an integer (completions) or true/false"
                            if completion else "'logprobs' must be true or false")
    if top is not None and not (is_int(top) and 0 <= top <= MAX_LOGPROBS):
        return "top_logprobs", f"'top_logprobs' must be an integer from 0 to {MAX_LOGPROBS}"
    wanted = (logprobs is not None and logprobs is not False) or bool(top)
    if wanted and body.get("stream"):
        return "logprobs", ("log probabilities are not returned in streamed responses: "
                            "request them without 'stream'")
    return None


def completion_logprobs(body: dict) -> dict:
    """A completions request's OpenAI ``logprobs: n`` as mlx-lm takes it
    (``logprobs: true`` and ``top_logprobs: n``)."""
    n = body.get("logprobs")
    if not is_int(n):
        return body
    return dict(body, logprobs=True, top_logprobs=n if n > 0 else body.get("top_logprobs", -1))


def _not_unicode(body: dict):
    """The first top-level field holding a string that UTF-8 cannot encode
    (a lone surrogate), or None. Iterative: a body nested as deep as the
    JSON parser allows must not exhaust the stack here."""
    for field, value in body.items():
        stack = [field, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str):
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return field if isinstance(field, str) and field.isprintable() else "body"
            elif isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return None
