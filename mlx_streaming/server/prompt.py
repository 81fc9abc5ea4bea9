"""A request's prompt as mlx-lm's ``_tokenize`` makes it, to check it
against the model's context before the request takes the model."""

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
