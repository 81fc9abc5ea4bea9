"""Speculative decoding through a streamed model: drafts checked K at a time,
lossless (greedy: the same tokens; sampling: the target's distribution), the
caches of a partly rejected call undone (docs/design.md, "decode/verify_drafts.py")."""

import time
from typing import Generator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.generate import GenerationResponse
from mlx_lm.models.cache import ArraysCache, make_prompt_cache

from ..errors import ConfigError
from ..flags import MAX_NUM_DRAFT
from ..runtime.prefill_step import step_of
from ..runtime.stats import SpecStats

DEFAULT_NUM_DRAFT = 3
DEFAULT_NGRAM = 3
PREFILL_STEP = 512


# -- drafts ------------------------------------------------------------------


class NgramDraft:
    """Prompt-lookup drafts: find the latest earlier occurrence of the last
    ``n`` tokens (``n`` from ``max_n`` down to 1) and propose what followed it.
    Deterministic, so its draft distribution ``q`` is one-hot."""

    name = "ngram"

    def __init__(self, max_n: int = DEFAULT_NGRAM):
        self.max_n = max_n
        self.tokens: List[int] = []

    def start(self, prompt: Sequence[int]) -> None:
        self.tokens = list(prompt)

    def propose(self, k: int) -> Tuple[List[int], Optional[np.ndarray]]:
        seq = self.tokens
        for n in range(min(self.max_n, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            # Latest earlier occurrence first: recent text predicts best.
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + k], None
        return [], None

    def commit(self, drafts: List[int], n: int, nxt: int) -> None:
        """The text gained ``drafts[:n]`` and then ``nxt``."""
        self.tokens.extend([*drafts[:n], nxt])


class ModelDraft:
    """Drafts from a small mlx-lm model (same tokenizer) with its own cache, which
    holds the text but ``pending``; sampling, also its probabilities [k, vocab]."""

    name = "model"

    def __init__(self, model, temp: float = 0.0):
        self.model = model
        self.temp = temp
        self.cache = None
        self.vocab: Optional[int] = None
        self.pending: List[int] = []
        self._fed: Optional[List[int]] = None
        self._checkpoint = None

    def limit_vocab(self, vocab: Optional[int]) -> None:
        """Draft only ids the target has (vocabularies padded differently)."""
        self.vocab = vocab

    def start(self, prompt: Sequence[int]) -> None:
        self.cache = make_prompt_cache(self.model)
        _prefill(self.model, self.cache, list(prompt[:-1]))
        self.pending = [int(prompt[-1])]

    def propose(self, k: int) -> Tuple[List[int], Optional[np.ndarray]]:
        self._checkpoint = Checkpoint(self.cache, len(self.pending) + k - 1)
        fed = list(self.pending)
        y = mx.array(fed)
        drafts, probs = [], []
        for i in range(k):
            logits = self.model(y[None], cache=self.cache)[0, -1][: self.vocab]
            if self.temp > 0:
                p = mx.softmax(logits.astype(mx.float32) / self.temp)
                token = mx.random.categorical(mx.log(p))
                if self.vocab is not None and p.shape[-1] < self.vocab:
                    p = mx.concatenate([p, mx.zeros((self.vocab - p.shape[-1],))])
                probs.append(p)
            else:
                token = mx.argmax(logits)
            drafts.append(token.item())
            if i < k - 1:
                y = mx.array(drafts[-1:])
                fed.append(drafts[-1])
        self._fed = fed
        return drafts, (np.array(mx.stack(probs)) if probs else None)

    def commit(self, drafts: List[int], n: int, nxt: int) -> None:
        """The text gained ``drafts[:n]`` and then ``nxt``."""
        if not drafts:
            self.pending.append(nxt)
            return
        if n == len(drafts):
            # All kept: the last draft was never fed to the draft model.
            self.pending = [drafts[-1], nxt]
        else:
            self._checkpoint.undo(self.model, self._fed, len(self.pending) + n)
            self.pending = [nxt]


def _prefill(model, cache, tokens: List[int]) -> None:
    step = min(PREFILL_STEP, step_of(model))
    for i in range(0, len(tokens), step):
        model(mx.array(tokens[i:i + step])[None], cache=cache)
        mx.eval([c.state for c in cache])


def _forward(model, tokens: List[int], cache, hidden: bool):
    """Logits of ``tokens``, and with ``hidden`` the final hidden states (pre-head)."""
    if not hidden:
        return model(mx.array(tokens)[None], cache=cache)[0], None
    runtime = model.streaming
    with runtime.call():  # as the model's own __call__ (wrap.one_pass_at_a_time)
        h = model.model(mx.array(tokens)[None], cache)
        logits = model.lm_head(h)
        mx.eval(logits, h)
    return logits[0], h[0]


def _prefill_hidden(model, cache, tokens: List[int]) -> Optional[mx.array]:
    step = min(PREFILL_STEP, step_of(model))
    states = [_forward(model, tokens[i:i + step], cache, True)[1]
              for i in range(0, len(tokens), step)]
    return mx.concatenate(states, axis=0) if states else None


def _vocab_size(model) -> Optional[int]:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None and isinstance(getattr(args, "text_config", None), dict):
        size = args.text_config.get("vocab_size")
    return size if isinstance(size, int) else None


# -- undoing a call ------------------------------------------------------------


class Checkpoint:
    """The caches before a call of ``n`` tokens that may be partly undone:
    trimmed, or restored from a snapshot and fed again (docs/design.md)."""

    def __init__(self, cache, n: int):
        self.cache = cache
        self.saved = [None if _stays_trimmable(c, n) else _snapshot(c) for c in cache]
        self.trimmable = all(s is None for s in self.saved)

    def undo(self, model, fed: Sequence[int], keep: int, held: Optional[int] = None) -> bool:
        """``fed`` tokens went in since the checkpoint, the cache holding the first
        ``held`` (default all); keep ``keep``. Returns whether any were fed again."""
        held = len(fed) if held is None else held
        if keep >= held:
            return False
        if self.trimmable:
            for c in self.cache:
                _trim(c, held - keep)
            return False
        for c, saved in zip(self.cache, self.saved):
            if saved is None:
                _trim(c, held)
            else:
                c.state = _copy_state(c, saved)  # the snapshot stays usable for a second undo
        if keep:
            model(mx.array(list(fed[:keep]))[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        return True


def _stays_trimmable(c, n: int) -> bool:
    if not c.is_trimmable():
        return False
    # A sliding window is trimmable only until it is full.
    window = getattr(c, "max_size", None)
    return window is None or c.offset + n < window


def _snapshot(c):
    return _copy_state(c, c.state)


def _copy_state(c, state):
    if isinstance(c, ArraysCache):
        return tree_map(lambda x: x, state)  # copies the lists, shares the arrays
    state = tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, state)
    mx.eval([x for _, x in tree_flatten(state) if isinstance(x, mx.array)])
    return state


def _trim(c, n: int) -> None:
    if c.trim(n) != n:
        raise RuntimeError(f"a {type(c).__name__} could not take back {n} tokens")


# -- the acceptance rule ---------------------------------------------------------


def accept_greedy(target: np.ndarray, drafts: Sequence[int]) -> Tuple[int, int]:
    """``target``: ``[k + 1]`` argmax tokens of the verify call. Returns
    (drafts accepted, the next token)."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return n, int(target[n])


def accept_sampled(p: np.ndarray, drafts: Sequence[int], q: Optional[np.ndarray],
                   rng: np.random.Generator) -> Tuple[int, int]:
    """Speculative sampling: ``p`` [k + 1, V] target and ``q`` [k, V] draft
    probabilities (None: one-hot drafts); returns (drafts accepted, next token)."""
    for i, x in enumerate(drafts):
        qx = 1.0 if q is None else float(q[i, x])
        if rng.random() * qx < p[i, x]:  # keep with probability min(1, p/q)
            continue
        residual = p[i].astype(np.float64).copy()
        if q is None:
            residual[x] = 0.0
        else:
            residual = np.maximum(residual - q[i], 0.0)
        total = residual.sum()
        if total <= 0:  # p == q at this position: any rejection is measure zero
            residual, total = p[i].astype(np.float64), p[i].sum()
        return i, int(rng.choice(len(residual), p=residual / total))
    last = p[len(drafts)].astype(np.float64)
    return len(drafts), int(rng.choice(len(last), p=last / last.sum()))


# -- the loop ------------------------------------------------------------------


def speculative_generate_step(
    prompt: Sequence[int], model, draft, *, num_draft_tokens: int = DEFAULT_NUM_DRAFT,
    max_tokens: int = 256, temp: float = 0.0, seed: int = 0,
    prompt_cache=None, stats: Optional[SpecStats] = None, context: Sequence[int] = (),
    settle: bool = False,
) -> Generator[Tuple[int, bool], None, None]:
    """Yield ``(token, logprobs, from_draft)`` of the target ``model``'s decoding
    of ``prompt``, drafting ``num_draft_tokens`` at a time with ``draft``.

    Args:
        draft: an ``NgramDraft``, ``ModelDraft`` or ``mtp.MtpDraft``.
        temp: 0 for greedy (token-identical to plain greedy decoding), else
            the sampling temperature (the target's distribution is kept).
        seed: of the acceptance rule's random numbers.
        stats: counters to update (default: ``stats(model)["speculative"]``'s).
        context: tokens before ``prompt`` that ``prompt_cache`` already holds.
        settle: at the end, leave the cache holding the prompt and exactly the
            tokens yielded, as mlx-lm's server expects of a kept cache.
    """
    if not 1 <= num_draft_tokens <= MAX_NUM_DRAFT:
        raise ConfigError(f"num_draft_tokens must be between 1 and {MAX_NUM_DRAFT}, "
                          f"got {num_draft_tokens}")
    prompt = [int(t) for t in prompt]
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    if stats is None:
        runtime = getattr(model, "streaming", None)
        stats = runtime.speculative if runtime is not None else SpecStats()
    rng = np.random.default_rng(seed)
    if hasattr(draft, "limit_vocab"):
        draft.limit_vocab(_vocab_size(model))
    # MTP drafts read the target's hidden states (mtp.MtpDraft).
    hidden = getattr(draft, "needs_hidden", False)
    if hidden:
        draft.start(prompt, _prefill_hidden(model, cache, prompt[:-1]))
    else:
        _prefill(model, cache, prompt[:-1])
        draft.start([int(t) for t in context] + prompt)
    out: List[int] = []  # tokens yielded
    cached = len(prompt) - 1  # tokens of prompt + out that the cache holds
    step = None  # (tokens held before the call, fed, checkpoint) of the last call
    try:
        y = prompt[-1]
        while max_tokens < 0 or len(out) < max_tokens:
            k = num_draft_tokens if max_tokens < 0 else min(num_draft_tokens,
                                                            max_tokens - len(out) - 1)
            drafts, q = draft.propose(k) if k > 0 else ([], None)
            fed = [y, *drafts]
            checkpoint = Checkpoint(cache, len(fed))
            logits, states = _forward(model, fed, cache, hidden)  # [len(fed), V], [len(fed), H]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if temp > 0:
                p = np.array(mx.softmax(logits.astype(mx.float32) / temp, axis=-1))
                n, nxt = accept_sampled(p, drafts, q, rng)
            else:
                n, nxt = accept_greedy(np.array(mx.argmax(logits, axis=-1)), drafts)
            stats.calls += 1
            stats.drafted += len(drafts)
            stats.accepted += n
            # The cache holds fed; keep y and the accepted drafts.
            stats.refeeds += checkpoint.undo(model, fed, n + 1)
            step = (cached, fed, checkpoint)
            cached += n + 1
            if hidden:
                draft.commit(drafts, n, nxt, states[: n + 1])
            else:
                draft.commit(drafts, n, nxt)
            for i, t in enumerate(drafts[:n]):
                out.append(t)
                yield t, logprobs[i], True
            out.append(nxt)
            yield nxt, logprobs[n], False
            y = nxt
    except GeneratorExit:
        if settle:
            _settle(model, cache, prompt + out, cached, step)
        raise
    if settle:
        _settle(model, cache, prompt + out, cached, step)


def _settle(model, cache, seq: List[int], cached: int, step) -> None:
    """Make the cache hold exactly ``seq`` (the prompt and every token yielded), as
    mlx-lm's server expects; it holds ``seq[:cached]`` and unyielded accepted drafts."""
    if cached < len(seq):
        model(mx.array(seq[cached:])[None], cache=cache)
        mx.eval([c.state for c in cache])
    elif cached > len(seq):
        before, fed, checkpoint = step
        checkpoint.undo(model, fed, len(seq) - before, held=cached - before)


def stream_generate(model, tokenizer, prompt, draft, *, max_tokens: int = 256,
                    num_draft_tokens: int = DEFAULT_NUM_DRAFT, temp: float = 0.0,
                    seed: int = 0, stats: Optional[SpecStats] = None, prompt_cache=None,
                    context: Sequence[int] = (), settle: bool = False,
                    ) -> Generator[GenerationResponse, None, None]:
    """``mlx_lm.stream_generate`` with drafts: the same ``GenerationResponse``
    stream (``from_draft`` says which tokens were accepted drafts).
    ``prompt_cache``, ``context`` and ``settle`` as ``speculative_generate_step``'s."""
    if isinstance(prompt, str):
        # As mlx-lm: no second BOS when the text already starts with one.
        bos = getattr(tokenizer, "bos_token", None)
        prompt = tokenizer.encode(prompt, add_special_tokens=bos is None
                                  or not prompt.startswith(bos))
    prompt = [int(t) for t in prompt]
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    tic = time.perf_counter()
    prompt_tps, n, token, logprobs, from_draft = 0.0, 0, None, None, False
    steps = speculative_generate_step(prompt, model, draft, num_draft_tokens=num_draft_tokens,
                                      max_tokens=max_tokens, temp=temp, seed=seed,
                                      stats=stats, prompt_cache=prompt_cache, context=context,
                                      settle=settle)
    finish = "length"
    try:
        for n, (token, logprobs, from_draft) in enumerate(steps, start=1):
            if n == 1:
                prompt_tps = len(prompt) / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                finish = "stop"
                break
            detokenizer.add_token(token)
            if n == max_tokens:
                break
            yield _response(detokenizer.last_segment, token, logprobs, from_draft,
                            len(prompt), prompt_tps, n, tic, None)
    finally:
        steps.close()  # settles the cache, before its holder stores it
    detokenizer.finalize()
    yield _response(detokenizer.last_segment, token, logprobs, from_draft, len(prompt),
                    prompt_tps, n, tic, finish)


def _response(text, token, logprobs, from_draft, prompt_tokens, prompt_tps, n, tic, finish):
    return GenerationResponse(
        text=text, token=token, logprobs=logprobs, from_draft=from_draft,
        prompt_tokens=prompt_tokens, prompt_tps=prompt_tps, generation_tokens=n,
        generation_tps=n / max(time.perf_counter() - tic, 1e-9),
        peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish)
