"""Generate text from a stream directory, streaming experts from SSD.

    python -m mlx_streaming.generate --model DIR --prompt "..." --max-tokens N
        [--cache-gb X] [--temp T] [--stats-json FILE]

Ends with prompt and decode tok/s, expert hit rate, GB read, read GB/s and
peak memory; ``--stats-json`` writes them (and the per-layer counters).
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from .cli import log_to_stderr, run_main, write_out
from .config import add_config_flags, config_from_args
from .errors import ConfigError, first_line
from .flags import MAX_NUM_DRAFT, MAX_TOKENS, MIN_TEMPERATURE, Parser, count, number, temperature
from .predict.against import against, describe, read_forecast
from .sharded import add_sharded_flags, load_sharded, lost, watch

# Heavy imports (mlx, mlx-lm) happen inside main's body, where an
# interrupt during start-up is one line, not a traceback.

DEFAULT_PROMPT = "def "
DRAFT_CHOICES = ("ngram", "mtp")
DEFAULT_NUM_DRAFT = 3  # verify_drafts.DEFAULT_NUM_DRAFT (not imported: heavy)
DEFAULT_MAX_TOKENS = 100


def setup_arg_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mlx_streaming generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="stream directory (mlx_streaming convert) or Hugging Face repo id")
    p.add_argument("--revision", default=None,
                   help="of a repo id: branch, tag or commit (default main)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt; - reads it from "
                   "standard input (as mlx-lm's generate)")
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=DEFAULT_MAX_TOKENS,
                   help="tokens to generate at most (1 or more)")
    p.add_argument("--temp", type=temperature, default=0.0,
                   help=f"sampling temperature: 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    p.add_argument("--top-p", type=number(0, 1, open_low=True), default=1.0)
    p.add_argument("--seed", type=count(0, 2**63 - 1), default=0)
    p.add_argument("--ignore-chat-template", action="store_true")
    p.add_argument("--echo-prompt", action="store_true",
                   help="print the prompt before the text generated after it")
    p.add_argument("--stats-json", default=None, help="write the run's numbers here")
    p.add_argument("--forecast", default=None,
                   help="`mlx_streaming predict --json` output: say where the measured decode "
                        "speed fell against its band")
    p.add_argument("--draft", choices=DRAFT_CHOICES, default=None,
                   help="speculative decoding with drafts: ngram (prompt lookup, no second "
                        "model) or mtp (the model's own MTP layers); off by default")
    p.add_argument("--draft-model", default=None,
                   help="speculative decoding with this mlx-lm model (same tokenizer) as the "
                        "drafter")
    p.add_argument("--num-draft-tokens", type=count(1, MAX_NUM_DRAFT), default=DEFAULT_NUM_DRAFT,
                   help="tokens drafted per verify call")
    add_config_flags(p)
    add_sharded_flags(p)
    return p


def check_args(args) -> None:
    """What the flags' own types cannot check: the prompt, and flags that
    go together."""
    if not args.prompt:
        raise ConfigError("the prompt is empty; pass some text with --prompt")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the locale could not decode, as surrogates
        raise ConfigError("the prompt is not valid UTF-8 text") from None
    if args.draft and args.draft_model:
        raise ConfigError("pass either --draft or --draft-model, not both")
    if args.stats_json:
        _check_writable(Path(args.stats_json))
    if (args.draft or args.draft_model) and args.top_p < 1:
        raise ConfigError("--top-p is not supported with drafts; use --temp alone")
    if (args.draft or args.draft_model) and (args.tensor_parallel or args.pipeline):
        raise ConfigError("drafts do not run on a model split over ranks; leave out --draft")


def _check_writable(out: Path) -> None:
    """``--stats-json`` known writable before the model loads, not after
    the whole generation: a file opened for appending (which changes
    nothing in it), or made and removed again. A device, a pipe or a
    link to nothing is left for the end (opening a pipe would block)."""
    if out.is_dir() or not out.resolve().parent.is_dir():
        raise ConfigError(f"cannot write --stats-json {out} (not a file in an existing "
                          "directory)")
    existed = os.path.lexists(out)
    if existed and not out.is_file():
        return
    try:
        with open(out, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write --stats-json {out} ({e.strerror})") from None
    if not existed:
        out.unlink()


def format_prompt(tokenizer, prompt: str, ignore_template: bool):
    if ignore_template or getattr(tokenizer, "chat_template", None) is None:
        return prompt
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def summarize(response, report: dict) -> dict:
    t = report["total"]
    return {
        "prompt_tokens": response.prompt_tokens,
        "prompt_tps": response.prompt_tps,
        "generation_tokens": response.generation_tokens,
        "generation_tps": response.generation_tps,
        "peak_memory_gb": response.peak_memory,
        "hit_rate": t["hit_rate"],
        "gb_read": t["bytes_read"] / 1e9,
        "spine_gb_read": (report["spine"] or {}).get("read_gb"),
        "read_gb_per_s": t["read_gb_per_s"],
        "io": report["io"],
        "residency": report["residency"],
        "slots_per_layer": report["slots_per_layer"],
        "num_experts": report["num_experts"],
        "pool_gb": report["pool_bytes"] / 1e9,
        "syncs_per_token": t["syncs"] / max(1, t["tokens"] // max(1, report["moe_layers"])),
        "prefetch": report["prefetch_decision"],
        "draft_acceptance": report["speculative"]["acceptance_rate"],
        "route_agreement": (report["routing"].get("route_agreement")
                            if report["routing"].get("approximate") else None),
        "miss_bits": report["miss_bits"],
    }


def print_summary(s: dict) -> None:
    hit = "n/a" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}"
    rate = "n/a" if s["read_gb_per_s"] is None else f"{s['read_gb_per_s']:.2f} GB/s"
    print(
        f"prompt: {s['prompt_tokens']} tokens, {s['prompt_tps']:.1f} tok/s | "
        f"decode: {s['generation_tokens']} tokens, {s['generation_tps']:.1f} tok/s\n"
        f"experts: hit rate {hit}, {s['gb_read']:.3f} GB read, {rate} | "
        f"{s['slots_per_layer']}/{s['num_experts']} slots per layer ({s['pool_gb']:.3f} GB) | "
        f"peak memory {s['peak_memory_gb']:.3f} GB | io {s['io']}"
        + ("" if s["spine_gb_read"] is None else
           f" | spine layers: {s['spine_gb_read']:.3f} GB read")
        + ("" if s["draft_acceptance"] is None else
           f" | drafts accepted {s['draft_acceptance']:.0%}")
        + ("" if s.get("route_agreement") is None else
           f"\nrouting: approximate, {s['route_agreement']:.1%} of the router's choices kept")
        + _miss_bits_line(s.get("miss_bits"))
        + ("" if s.get("forecast") is None else "\n" + describe(s["forecast"])),
        file=sys.stderr,
    )


def _miss_bits_line(m) -> str:
    if m is None:
        return ""
    share = "" if m["share_of_misses"] is None else f" ({m['share_of_misses']:.0%} of misses)"
    return (f"\nmiss reads: approximate, {m['substituted']} missed (token, expert) pairs "
            f"computed from {m['bits']}-bit copies{share}")


def _responses(args, model, tokenizer, prompt, sampler):
    """mlx-lm's token stream, or the speculative one when drafts are asked."""
    from mlx_lm import stream_generate

    from .runtime.prefill_step import step_of

    if not (args.draft or args.draft_model):
        return stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                               sampler=sampler, prefill_step_size=step_of(model))
    from .decode import verify_drafts

    if args.draft_model:
        import mlx_lm

        try:
            drafter, draft_tokenizer = mlx_lm.load(args.draft_model)
        except Exception as e:  # mlx-lm and huggingface_hub raise many kinds
            raise ConfigError(f"--draft-model {args.draft_model} cannot be loaded by mlx-lm "
                              f"({type(e).__name__}: {first_line(e)}); "
                              "give an mlx-lm model directory or repo id") from None
        if not same_tokenizer(tokenizer, draft_tokenizer):
            print(f"[mlx_streaming] warning: --draft-model {args.draft_model} has another "
                  "tokenizer than the model: its drafts will rarely be accepted (the output "
                  "is the model's all the same)", file=sys.stderr)
        draft = verify_drafts.ModelDraft(drafter, temp=args.temp)
    elif args.draft == "mtp":
        from .decode.mtp import MtpDraft

        draft = MtpDraft(model)
    else:
        draft = verify_drafts.NgramDraft()
    # A text prompt is encoded there, with mlx-lm's rule for a leading BOS.
    return verify_drafts.stream_generate(model, tokenizer, prompt, draft,
                                       max_tokens=args.max_tokens,
                                       num_draft_tokens=args.num_draft_tokens,
                                       temp=args.temp, seed=args.seed)


# Text both tokenizers must split alike for a draft model's tokens to mean
# what the model's do.
TOKENIZER_PROBE = "def f(x):\n    return {'a': [1, 2.5], \"é\": None}  # Hello, world!"


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers have one vocabulary size and split a probe
    text into the same ids (mlx-lm's own check is the size alone)."""
    return a.vocab_size == b.vocab_size and a.encode(TOKENIZER_PROBE) == \
        b.encode(TOKENIZER_PROBE)


def _generation(args, model, tokenizer, prompt, sampler, split, dog):
    """The responses, each a heartbeat of the watchdog of a split run; a
    collective that fails there is a lost rank."""
    try:
        for response in _responses(args, model, tokenizer, prompt, sampler):
            if dog is not None:
                dog.beat()
            yield response
    except RuntimeError as e:
        if split is None:
            raise
        raise lost(split[2], e) from None
    finally:
        if dog is not None:
            dog.stop()


def _follow(args, model, tokenizer, split) -> int:
    """A rank other than 0: the same generation, silently, then its stats
    gathered to rank 0."""
    from mlx_lm.sample_utils import make_sampler

    prompt = format_prompt(tokenizer, args.prompt, args.ignore_chat_template)
    sampler = make_sampler(args.temp, args.top_p)
    dog = watch(split, args.rank_timeout)
    response = None
    for response in _generation(args, model, tokenizer, prompt, sampler, split, dog):
        pass
    if response is not None:
        _rank_stats(model, split)
    model.streaming.close()
    return 0


def _rank_stats(model, split):
    """Every rank's stats, printed one line each by rank 0 (None alone)."""
    if split is None:
        return None
    from .runtime.sharding import sharded_stats

    ranks = sharded_stats(model)
    if split[2] == 0:
        for r, report in enumerate(ranks):
            t = report["total"]
            hit = "n/a" if t["hit_rate"] is None else f"{t['hit_rate']:.1%}"
            tokens = t["tokens"] // max(1, report["moe_layers"])
            print(f"rank {r}: hit rate {hit}, {t['bytes_read'] / 1e9:.3f} GB read over "
                  f"{tokens} tokens ({report['moe_layers']} MoE layers)", file=sys.stderr)
    return ranks


def _read_stdin() -> str:
    """The prompt from standard input, as UTF-8 text whatever the locale."""
    if sys.stdin is None:
        raise ConfigError("--prompt - reads standard input, and there is none")
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("the prompt is not valid UTF-8 text") from None


def main(argv=None) -> int:
    def body():
        args = setup_arg_parser().parse_args(argv)
        log_to_stderr()
        check_args(args)
        if args.prompt == "-":
            args.prompt = _read_stdin()
            check_args(args)
        # A wrong forecast file is known before the model loads.
        forecast = read_forecast(args.forecast) if args.forecast else None
        config = config_from_args(args)
        if args.draft == "mtp" and not config.mtp:
            config = replace(config, mtp=True)
        import mlx.core as mx
        from mlx_lm.sample_utils import make_sampler

        from .runtime.loader import load
        from .runtime.stats import stats

        mx.random.seed(args.seed)
        split = load_sharded(args, config)
        if split is None:
            model, tokenizer = load(args.model, revision=args.revision, config=config)
        else:
            model, tokenizer, rank = split
            if rank != 0:  # rank 0 speaks for every rank
                return _follow(args, model, tokenizer, split)
        report = stats(model)
        print(f"[mlx_streaming] reader: {report['io']} ({report['io_reason']}); "
              f"{report['slots_per_layer']}/{report['num_experts']} experts per layer "
              f"resident ({report['residency']})", file=sys.stderr)
        memory = report["memory"]
        if memory["streamed_layers"]:
            print(f"[mlx_streaming] spine: {memory['pinned_layers']} layers resident, "
                  f"{len(memory['streamed_layers'])} streamed through "
                  f"{memory['ring_buffers']} buffers ({memory['ring_gb']:.3f} GB); budget "
                  f"{memory['budget_gb']:.2f} GB from {memory['source']}", file=sys.stderr)
        prompt = format_prompt(tokenizer, args.prompt, args.ignore_chat_template)
        if not (tokenizer.encode(prompt) if isinstance(prompt, str) else prompt):
            raise ConfigError("the prompt encodes to no tokens; pass some text with --prompt")
        sampler = make_sampler(args.temp, args.top_p)
        if args.echo_prompt:
            write_out(args.prompt)
        response = None
        dog = watch(split, args.rank_timeout)
        for response in _generation(args, model, tokenizer, prompt, sampler, split, dog):
            text = response.text
            if args.echo_prompt and response.generation_tokens == 1 and text and \
                    not text[0].isspace() and tokenizer.decode([response.token]).startswith(" "):
                # The streaming detokenizer drops the first token's leading
                # space, which belongs between the prompt and the reply.
                text = " " + text
            write_out(text)
        write_out("", end="\n")
        if response is None:
            model.streaming.close()
            return 0
        report = stats(model)
        summary = summarize(response, report)
        if forecast is not None:
            summary["forecast"] = against(forecast, summary["generation_tps"],
                                          summary["slots_per_layer"])
        print_summary(summary)
        ranks = _rank_stats(model, split)
        if args.stats_json:
            try:
                with open(args.stats_json, "w") as f:
                    json.dump({"summary": summary, "stats": report, "ranks": ranks}, f,
                              indent=1)
            except OSError as e:
                raise ConfigError(f"cannot write --stats-json {args.stats_json} "
                                  f"({e.strerror})") from None
        model.streaming.close()

    return run_main(body)


if __name__ == "__main__":
    from .cli import leave

    leave(main())
