"""A server of the OpenAI, Ollama and Anthropic APIs on a streamed model.

    python -m mlx_streaming.server --model DIR [--cache-gb X | --slots-per-layer N]
        [--host 127.0.0.1] [--port 8080] [--max-queue 4] [--memo-mb 64] [...]

This is mlx-lm's own server (``mlx_lm.server``: HTTP handling, request
parsing, chat templates, SSE streaming, stop strings, logprobs, tool calls,
its prompt cache) with the streaming loader plugged in where it loads
models. On top of it:

- one generation at a time on the model's pools, requests served in
  arrival order; beyond ``--max-queue`` waiting requests the answer is 429
  with ``Retry-After``, never a hang;
- OpenAI-style 4xx errors for bad JSON, bad parameters, an unknown model id
  and a prompt longer than the model's context;
- Ollama's ``/api/*`` and Anthropic's ``/v1/messages``, translated into
  OpenAI requests (``apis.py``): the same queue, prompt cache and memory
  plan; ``--ollama-port`` listens on a second port too;
- ``GET /v1/stats``: the model's streaming counters and recent requests;
- ``--memo-mb N``: greedy (temperature 0) requests equal to an earlier one
  are answered from a bounded in-memory LRU of responses, marked by the
  ``X-MLX-Streaming-Memo: hit`` header; sampled requests never are.

Every mlx-lm server flag is accepted too (``--temp``, ``--max-tokens``,
``--chat-template`` ...), and every ``load`` option (``--prefetch`` ...).
"""
