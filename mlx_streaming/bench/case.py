"""One measurement, run in its own process by ``runs.run_case``:

    python -m mlx_streaming.bench.case '{"op": "decode", "kind": "streaming", ...}'

Prints one JSON line with the numbers. ``kind`` is ``mlx-lm`` (the model
loaded fully), ``mlx-lm-lazy`` (mlx-lm loading weights as they are first
used: the naive way to run a model larger than memory), ``streaming`` or
``sharded`` (one rank of a tensor-parallel run).
"""

import json
import sys
import time

import mlx.core as mx
import numpy as np

from .inputs import prompt_tokens
from .limits import peak_rss_bytes

# Decode tokens a decode case runs before it starts counting: they pay
# one-time costs and fill the pool.
WARMUP_TOKENS = 4


def _load(case):
    if case["kind"] == "streaming":
        from ..runtime.loader import load

        return load(case["model"], **case.get("load", {}))
    if case["kind"] == "sharded":  # one rank of a tensor-parallel run (bench.ranks)
        from ..runtime.loader import sharded_load

        return sharded_load(case["model"], tensor_group=mx.distributed.init(),
                            **case.get("load", {}))
    import mlx_lm

    return mlx_lm.load(case["model"], lazy=case["kind"] == "mlx-lm-lazy")


def _greedy(logits):
    return mx.argmax(logits, axis=-1)


def _streaming_totals(model):
    from ..runtime.stats import stats

    return stats(model) if hasattr(model, "streaming") else None


def _reset(model):
    if hasattr(model, "streaming"):
        from ..runtime.stats import reset_stats

        reset_stats(model)


def decode(case, model, tokenizer) -> dict:
    """Decode ``max_tokens`` greedily with mlx-lm's own ``generate_step``;
    the decode rate excludes the prompt and the first token."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    prompt = mx.array(prompt_tokens(tokenizer, case.get("prompt_tokens", 32), case.get("seed", 0)))
    warmup = case.get("warmup_tokens", WARMUP_TOKENS)
    # Greedy decoding of a small model falls into loops that re-use the
    # same experts; sampling (seeded, so every case decodes alike) does not.
    temp = case.get("temp", 0.0)
    sampler = make_sampler(temp) if temp > 0 else _greedy
    mx.random.seed(case.get("seed", 0))
    steps = generate_step(prompt, model, max_tokens=case["max_tokens"] + warmup, sampler=sampler)
    start = time.perf_counter()
    next(steps)
    prefill_s = time.perf_counter() - start
    # The first tokens pay one-time costs (allocations, first reads).
    for _ in range(warmup - 1):
        next(steps)
    first = time.perf_counter()
    _reset(model)
    n = sum(1 for _ in steps)
    end = time.perf_counter()
    return dict(prefill_s=prefill_s, decode_tokens=n, decode_s=end - first,
                decode_tps=n / (end - first), stats=_streaming_totals(model))


def verify(case, model, tokenizer) -> dict:
    """Multi-token verification: K draft tokens checked in one call, as MTP
    and speculative decoding do, K = 1..max_k."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    text = prompt_tokens(tokenizer, 64 + case["repeats"] * case["max_k"] * 2, case.get("seed", 0))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([text[:64]]), cache=cache))
    rows = []
    pos = 64
    for k in range(1, case["max_k"] + 1):
        _reset(model)
        times = []
        for _ in range(case["repeats"]):
            draft = mx.array([text[pos : pos + k]])
            start = time.perf_counter()
            mx.eval(model(draft, cache=cache))
            times.append(time.perf_counter() - start)
            trim_prompt_cache(cache, k)
            pos += 1
        s = _streaming_totals(model)
        rows.append(dict(k=k, call_s=float(np.median(times)),
                         bytes_read_per_call=(s["total"]["bytes_read"] / case["repeats"]) if s else None,
                         stats=s))
    return dict(rows=rows)


def speculative(case, model, tokenizer) -> dict:
    """Decode ``tokens`` greedily from real prompts (code and prose), plain
    and with each draft in ``drafts`` (``ngram``, ``mtp`` or ``model:PATH``)
    at each ``ks``; the time of a run includes its prompt. With an mlx-lm model and a
    model draft, mlx-lm's own speculative decoding runs too."""
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.generate import speculative_generate_step as mlx_spec

    from ..decode.verify_drafts import SpecStats, speculative_generate_step

    n = case["tokens"]
    drafters = {d: mlx_lm.load(d.split(":", 1)[1])[0] for d in case["drafts"]
                if d.startswith("model:")}
    rows = []
    for label, prompt in _spec_prompts(tokenizer, case.get("prompt_tokens", 48)):
        plain, plain_s = _timed(lambda: generate_step(mx.array(prompt), model, max_tokens=n,
                                                      sampler=_greedy))
        rows.append(dict(prompt=label, draft="none", k=0, tps=n / plain_s))
        for d in case["drafts"]:
            for k in case["ks"]:
                if d == "mtp" and case["kind"] != "streaming":
                    continue  # mlx-lm drops MTP layers
                spec = SpecStats()
                draft = _make_draft(d, model, drafters)
                _reset(model)
                toks, secs = _timed(lambda: speculative_generate_step(
                    prompt, model, draft, num_draft_tokens=k, max_tokens=n, stats=spec))
                rows.append(dict(prompt=label, draft=d, k=k, tps=n / secs,
                                 vs_plain=plain_s / secs, exact=toks == plain,
                                 acceptance=spec.accepted / spec.drafted if spec.drafted else None,
                                 tokens_per_call=n / spec.calls, stats=_streaming_totals(model)))
                if d in drafters and case["kind"] != "streaming":
                    toks, secs = _timed(lambda: mlx_spec(mx.array(prompt), model,
                                                         drafters[d], num_draft_tokens=k,
                                                         max_tokens=n, sampler=_greedy))
                    rows.append(dict(prompt=label, draft=f"{d} (mlx-lm)", k=k,
                                     tps=n / secs, vs_plain=plain_s / secs,
                                     exact=toks == plain))
    return dict(rows=rows)


def _make_draft(name, model, drafters):
    from ..decode.verify_drafts import ModelDraft, NgramDraft

    if name == "mtp":
        from ..decode.mtp import MtpDraft

        return MtpDraft(model)
    return ModelDraft(drafters[name]) if name in drafters else NgramDraft()


def _timed(make_steps):
    """Tokens of a generator of ``(token, ...)`` and the seconds of the
    whole run, the prompt included (the same prompt for every case): a
    speculative first call may yield several tokens, so there is no
    first-token mark that is fair to both."""
    start = time.perf_counter()
    tokens = [int(t[0]) for t in make_steps()]
    return tokens, max(time.perf_counter() - start, 1e-9)


def _spec_prompts(tokenizer, n: int):
    """A code prompt (the standard library, what the trained models read)
    and a prose one (Python's documentation topics, not in that corpus)."""
    from pydoc_data.topics import topics

    prose = " ".join(topics[k] for k in ("assert", "break", "continue", "pass"))
    ids = tokenizer.encode(" ".join(prose.split()))
    return [("code", prompt_tokens(tokenizer, n, 3)), ("prose", ids[:n])]


def prefill(case, model, tokenizer) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    rows = []
    step = case.get("prefill_step", 2048)
    for n in case["lengths"]:
        prompt = prompt_tokens(tokenizer, n, case.get("seed", 0))
        cache = make_prompt_cache(model)
        _reset(model)
        start = time.perf_counter()
        for i in range(0, n, step):
            mx.eval(model(mx.array([prompt[i : i + step]]), cache=cache))
        seconds = time.perf_counter() - start
        s = _streaming_totals(model)
        rows.append(dict(tokens=n, seconds=seconds, prompt_tps=n / seconds,
                         bytes_read_per_token=(s["total"]["bytes_read"] / n) if s else None))
    return dict(rows=rows)


def routing(case, model, tokenizer) -> dict:
    """Teacher-forced decode of real text, one token per call: the routing
    trace of a model reading text (``load`` must name a trace file)."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = prompt_tokens(tokenizer, case["tokens"] + 1, case.get("seed", 0))
    cache = make_prompt_cache(model)
    for t in tokens:
        mx.eval(model(mx.array([[t]]), cache=cache))
    s = _streaming_totals(model)
    model.streaming.close()
    return dict(tokens=len(tokens), stats=s)


def reads(case, model, tokenizer) -> dict:
    """The reader's cost per call as decode pays it: seconds of one read
    call of 1 record and of ``batch`` records (random experts of layer 0,
    into the pool's slots, as a miss does), medians of ``repeats``. A line
    through both gives a latency per call and a rate per byte."""
    store = model.streaming.stores[0]
    spec = store.spec
    rng = np.random.default_rng(case.get("seed", 0))
    out = {}
    for n in (1, case.get("batch", spec.top_k)):
        n = min(n, store.pool.slots, spec.num_experts)
        times = []
        for _ in range(case.get("repeats", 20)):
            experts = rng.choice(spec.num_experts, size=n, replace=False).astype(np.int64)
            slots = np.arange(n, dtype=np.int64)
            start = time.perf_counter()
            store._read(experts, slots, np.zeros(n, dtype=bool))
            times.append(time.perf_counter() - start)
        out[n] = float(np.median(times))
    (n1, t1), (n2, t2) = sorted(out.items())
    per_record = (t2 - t1) / (n2 - n1) if n2 > n1 else t1
    if per_record <= 0:  # noise swamped the slope: all of it per record
        per_record = t2 / n2
    latency = max(0.0, t1 - per_record)
    return dict(seconds=out, latency_s=latency,
                gbps=spec.stride / per_record / 1e9 if per_record > 0 else None,
                record_bytes=spec.stride)


def quality(case, model, tokenizer) -> dict:
    """Teacher-forced decode of ``tokens`` tokens of ``text``, one token per
    call, or with ``batch`` B the text cut into B streams decoded together
    (one token of each per call, as batched serving decodes): perplexity,
    and with ``reference`` (the exact run's log-probs, which ``save``
    writes) top-1 agreement and mean KL(exact || this)."""
    from mlx_lm.models.cache import make_prompt_cache

    batch = case.get("batch", 1)
    with open(case["text"], errors="ignore") as f:
        tokens = tokenizer.encode(f.read())[: case["tokens"]]
    length = len(tokens) // batch
    if length < 2:
        raise ValueError(f"{case['text']} holds fewer than 2 tokens per stream")
    streams = np.array(tokens[: batch * length]).reshape(batch, length)
    cache = make_prompt_cache(model)
    rows, start = [], None
    for i in range(length - 1):
        if i == WARMUP_TOKENS:
            start = time.perf_counter()
        logits = model(mx.array(streams[:, i : i + 1]), cache=cache)[:, -1].astype(mx.float32)
        rows.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        mx.eval(rows[-1])
    end = time.perf_counter()
    # (stream, position) order: one stream's tokens after another's.
    logp = np.stack([np.array(r) for r in rows], axis=1).reshape(-1, rows[0].shape[-1])
    nll = -logp[np.arange(len(logp)), streams[:, 1:].reshape(-1)]
    out = dict(tokens=len(logp), ppl=float(np.exp(nll.mean())), stats=_streaming_totals(model))
    if start is not None:
        out["decode_tps"] = batch * (length - 1 - WARMUP_TOKENS) / (end - start)
    if case.get("save") and mx.distributed.init().rank() == 0:  # ranks hold the same logits
        np.save(case["save"], logp)
    if case.get("reference"):
        ref = np.load(case["reference"]).astype(np.float32)
        if ref.shape != logp.shape:
            raise ValueError(f"the exact run's log-probs are {ref.shape}, this run's "
                             f"{logp.shape}: not the same text")
        out["top1_agreement"] = float(np.mean(ref.argmax(-1) == logp.argmax(-1)))
        out["kl"] = float(np.mean(np.sum(np.exp(ref) * (ref - logp), axis=-1)))
    return out


OPS = {"quality": quality, "decode": decode, "verify": verify, "prefill": prefill, "routing": routing,
       "reads": reads, "speculative": speculative}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    case = json.loads(argv[0])
    start = time.perf_counter()
    model, tokenizer = _load(case)
    load_s = time.perf_counter() - start
    result = OPS[case["op"]](case, model, tokenizer)
    result.update(load_s=load_s, peak_rss_bytes=peak_rss_bytes(),
                  mlx_peak_bytes=mx.get_peak_memory())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    from ..cli import leave

    leave(main())
