"""A request's prompt as mlx-lm's ``_tokenize`` makes it, to check it
against the model's context before the request takes the model; and a
completion's tokens as OpenAI's completions ``logprobs`` show them."""

import copy

from mlx_lm.server import convert_chat, process_message_content


def prompt_text(tokenizer, body: dict, field: str, template_args: dict,
                images: bool) -> str:
    """The text the model would read: the prompt, or the messages through
    the chat template (``template_args``: the server's and the request's)."""
    if field == "prompt":
        return body["prompt"]
    if not tokenizer.has_chat_template:
        return convert_chat(body["messages"], body.get("role_mapping"))
    return tokenizer.apply_chat_template(
        _messages(body, images), add_generation_prompt=True,
        **dict(_template_args(body, template_args), tokenize=False))


def prompt_tokens(tokenizer, body: dict, field: str, text: str, template_args: dict,
                  images: bool) -> int:
    """How many tokens the prompt ``text`` (``prompt_text``'s) is."""
    if field == "prompt" or not tokenizer.has_chat_template:
        return len(tokenizer.encode(text))
    return len(tokenizer.apply_chat_template(
        _messages(body, images), add_generation_prompt=True,
        **dict(_template_args(body, template_args), tokenize=True)))


def _messages(body: dict, images: bool) -> list:
    messages = copy.deepcopy(body["messages"])  # converted in place
    process_message_content(messages, keep_images=images)
    return messages


def _template_args(body: dict, server_args: dict) -> dict:
    args = dict(server_args or {})
    args.update(body.get("chat_template_kwargs") or {})
    return dict(args, tools=body.get("tools") or None)


def continued_text(tokenizer, body: dict, template_args: dict) -> str:
    """The prompt of a chat whose last message, the assistant's, the
    model continues (a prefill): the template without a new generation
    prompt after it, as text that ``tokenizer.encode`` reads back (a
    leading BOS the encoder adds itself left out)."""
    text = tokenizer.apply_chat_template(
        _messages(body, False), add_generation_prompt=False, continue_final_message=True,
        **dict(_template_args(body, template_args), tokenize=False))
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and tokenizer.encode("")[:1] == [tokenizer.bos_token_id]:
        text = text[len(bos):]
    return text


def completion_logprobs_of(tokenizer, tokens, logprobs, top) -> dict:
    """OpenAI's completions ``logprobs``: each token's text, its log
    probability, the top tokens' (where asked, keyed by the same text, so
    a chosen token is found in its row) and where the token starts in the
    completion's text (as mlx-lm's streaming detokenizer made it, which may
    drop a leading space, or hold back a character's first bytes)."""
    detokenizer = tokenizer.detokenizer
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        detokenizer.add_token(t)
        at += len(detokenizer.last_segment)
    return {"tokens": [_token_text(tokenizer, t) for t in tokens],
            "token_logprobs": list(logprobs) or None,
            "top_logprobs": [{_token_text(tokenizer, d["id"]): d["logprob"] for d in row}
                             for row in top] or None,
            "text_offset": offsets}


def _token_text(tokenizer, token: int) -> str:
    """A token's text; for part of a character, its vocabulary entry (the
    parts would all read U+FFFD)."""
    text = tokenizer.decode([token])
    return text if "\ufffd" not in text else tokenizer.convert_ids_to_tokens(token)
