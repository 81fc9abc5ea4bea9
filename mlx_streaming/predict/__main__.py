"""``mlx_streaming predict MODEL --budget 70GB --machine m5-max-128gb``:
before any download, whether a model fits a Mac and how fast it would run,
from its config and safetensors headers alone (docs/predict.md)."""

import argparse
import json
import re
from typing import List, Optional

from ..cli import leave, run_main, write_out
from ..config import DEFAULT_POLICY, ROUTING_CHOICES, StreamConfig
from ..errors import ConfigError
from .curves import builtin_curve, trace_curve
from .headers import read_model
from .machines import MACHINES, machine
from .plan import fit
from .shape import model_shape, split
from .speed import RoutingForecast, SpeedModel, cold_fill_s, forecast, prefill_tok_s

GB = 1e9
DEFAULT_CONTEXT = 16384
# One all-reduce of a token's hidden state between Macs (Thunderbolt 5
# RDMA), two per layer: an estimate.
ALL_REDUCE_S = 50e-6


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_streaming predict",
        description="Whether a MoE model fits a Mac and how fast it would decode, from its "
                    "config and safetensors headers (no download).")
    p.add_argument("model", help="Hub repo id (mlx-lm or stream repo) or local directory")
    p.add_argument("--budget", required=True, type=_gb,
                   help="memory for the model (cache_gb), e.g. 70GB")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--machine", help=f"a Mac profile: {', '.join(MACHINES)}")
    where.add_argument("--here", action="store_true",
                       help="measure this machine's disk and compute (cached)")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT,
                   help="tokens of KV cache kept beside the model")
    p.add_argument("--ranks", type=int, default=1,
                   help="Macs splitting the model tensor-parallel (each with --budget)")
    p.add_argument("--policy", default=DEFAULT_POLICY, help="eviction policy of the pools")
    p.add_argument("--routing", default="exact", choices=ROUTING_CHOICES,
                   help="approximate routing (load()'s routing): forecast its effect on "
                        "misses; its output is approximate (docs/routing.md)")
    p.add_argument("--routing-keep", type=int, default=None,
                   help="the router's own top experts always taken (default: top-k / 2, "
                        "skip-misses 1)")
    p.add_argument("--routing-window", type=int, default=None,
                   help="cache-aware: the candidates a resident expert may come from "
                        "(default: 2 x top-k)")
    p.add_argument("--miss-bits", type=int, default=None,
                   help="misses read low-bit copies of this width (convert --miss-bits)")
    p.add_argument("--trace", help="routing trace of your own run (the trace option) for "
                                   "the hit rates, instead of the built-in curves")
    p.add_argument("--revision", help="of a repo id: branch, tag or commit")
    p.add_argument("--endpoint", help="Hub endpoint (default: huggingface_hub's, HF_ENDPOINT)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _gb(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(gb|g)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in GB (e.g. 70GB)")
    return float(m.group(1))


def predict(args) -> dict:
    if args.ranks < 1 or args.context < 0:
        raise ConfigError("--ranks takes 1 or more Macs and --context 0 or more tokens")
    if args.here:
        from .here import measure_here

        mac = measure_here()
    else:
        mac = machine(args.machine)
    files = read_model(args.model, args.revision, args.endpoint)
    whole = model_shape(files)
    shape = split(whole, args.ranks)
    config = StreamConfig(policy=args.policy, routing=args.routing,
                          routing_keep=args.routing_keep, routing_window=args.routing_window)
    routing = _routing(config, shape.top_k)
    result = fit(shape, mac, args.budget, args.context, config)
    curve = trace_curve(args.trace, args.policy) if args.trace else builtin_curve(args.policy)
    out = dict(model=args.model, machine=mac.name, budget_gb=args.budget, ranks=args.ranks,
               fits=result.fits, fetched_bytes=files.fetched,
               spine_gb=shape.spine_bytes / GB, experts_gb=shape.expert_bytes / GB,
               moe_layers=shape.moe_layers, experts_per_layer=shape.experts,
               top_k=shape.top_k, record_mb=shape.record_bytes / 1e6,
               context=args.context, kv_cache_gb=result.kv_bytes / GB,
               least_budget_gb=result.least_budget_gb, max_context=result.max_context,
               refusal=_for_predict(result.refusal), slots_per_layer=None, decode_tok_s=None,
               decode_tok_s_band=None, machine_sources=mac.sources,
               routing=routing.report())
    if not result.fits:
        return out
    plan = result.plan
    miss_share = _miss_share(files.config, args.miss_bits)
    extra = 0.0 if args.ranks == 1 else 2 * shape.moe_layers * ALL_REDUCE_S
    streamed = sum(d.nbytes for d in shape.manifest.dense if d.layer in plan.streamed)
    speed = forecast(shape, mac, plan.slots, curve, SpeedModel(), miss_share, extra,
                     spine_read_bytes=streamed, missable=routing.keep)
    if routing.approximate:
        exact = forecast(shape, mac, plan.slots, curve, SpeedModel(), miss_share, extra,
                         spine_read_bytes=streamed)
        out["routing"].update(exact_decode_tok_s=exact.tok_s,
                              exact_misses_per_token=exact.misses_per_token)
    resident = plan.base + plan.pinned_bytes + plan.pool
    rate = mac.ssd_rate(shape.record_bytes * miss_share, SpeedModel().queue_depth)
    out.update(speed.report(), slots_per_layer=plan.slots, plan=plan.report(),
               spine_gb_read_per_token=streamed / GB,
               ssd_gbps_at_record=rate / GB,
               cold_fill_s=cold_fill_s(resident, shape.record_bytes, mac),
               prefill_tok_s=prefill_tok_s(shape, mac, plan.slots, plan.prefill_step))
    return out


def _routing(config: StreamConfig, top_k: int) -> RoutingForecast:
    """The routing forecast, refused where the runtime refuses it."""
    from ..runtime.cache_aware import default_keep, default_window

    if config.routing == "exact":
        return RoutingForecast("exact", top_k, None)
    # As the runtime's default for a softmax router steered by its logits.
    keep = min(top_k, config.routing_keep or default_keep(top_k, config.routing, True))
    if config.routing != "cache-aware" and keep >= top_k:
        raise ConfigError(f"--routing-keep {keep} keeps all {top_k} experts the model routes a "
                          f"token to, so --routing {config.routing} changes nothing: use a "
                          f"--routing-keep below {top_k}, or --routing exact")
    window = (config.routing_window or default_window(top_k)
              if config.routing == "cache-aware" else None)
    return RoutingForecast(config.routing, keep, window)


def _for_predict(refusal: Optional[str]) -> Optional[str]:
    """The loader's refusal in predict's words: its budget is --budget."""
    return refusal and refusal.replace("--cache-gb", "--budget").replace("cache_gb=", "budget ")


def _miss_share(config: dict, miss_bits: Optional[int]) -> float:
    """Bytes a miss reads against a full record: low-bit copies are about
    (bits + 0.5) / (the model's bits + 0.5) of it (scales and biases)."""
    if miss_bits is None:
        return 1.0
    if not 2 <= miss_bits <= 8:
        raise ConfigError(f"--miss-bits {miss_bits}: use 2 to 8")
    bits = (config.get("quantization") or {}).get("bits", 16)
    return min(1.0, (miss_bits + 0.5) / (bits + 0.5))


def render(r: dict) -> str:
    head = (f"{r['model']} on {r['machine']}, budget {r['budget_gb']:g} GB"
            + (f" per Mac x {r['ranks']}" if r["ranks"] > 1 else "")
            + f" (read {r['fetched_bytes'] / 1e3:.0f} KB over the network)")
    lines = [head]
    least = (f"{r['least_budget_gb']:g} GB" if r["least_budget_gb"] is not None
             else "none on this machine")
    if not r["fits"]:
        lines += [f"DOES NOT FIT: {r['refusal']}", f"  smallest budget that fits: {least}"]
    else:
        lines.append("FITS")
    lines += [
        f"  spine        {r['spine_gb']:.2f} GB",
        f"  experts      {r['experts_gb']:.1f} GB: {r['moe_layers']} layers x "
        f"{r['experts_per_layer']} experts, top-{r['top_k']}, records of {r['record_mb']:.2f} MB",
        f"  KV cache     {r['kv_cache_gb']:.2f} GB at {r['context']} tokens"]
    if not r["fits"]:
        return "\n".join(lines)
    lines += [
        f"  largest context at this budget: {r['max_context']} tokens; smallest budget: {least}",
        f"  slots        {r['slots_per_layer']} per layer ({r['resident_fraction']:.0%} of "
        f"experts resident)",
        f"  cold fill    {r['cold_fill_s']:.1f} s (the first request reads the spine and fills "
        "the pools)",
        f"  decode       {r['decode_tok_s']:.1f} tok/s (band {r['decode_tok_s_band'][0]:.1f}-"
        f"{r['decode_tok_s_band'][1]:.1f}): compute {r['compute_s'] * 1e3:.1f} ms + calls "
        f"{r['calls_s'] * 1e3:.1f} ms + reads {r['reads_s'] * 1e3:.1f} ms per token (SSD "
        f"{r['ssd_gbps_at_record']:.1f} GB/s at this record size)",
        f"               hit rate {r['hit_rate']:.0%}, {r['misses_per_token']:.0f} misses per "
        f"token, from the curve {r['curve']}",
        f"  prefill      at most {r['prefill_tok_s']:.0f} tok/s (reads and weight passes; the "
        "arithmetic not counted)",
        *_routing_lines(r["routing"]),
        "A forecast, not a measurement: docs/predict.md shows how it compares with "
        "published ones."]
    return "\n".join(lines)


def _routing_lines(routing: dict) -> List[str]:
    if not routing["approximate"]:
        return []
    return [f"  routing      {routing['mode']}, keep {routing['keep']}: a forecast for APPROXIMATE "
            f"output (not the model's exact one; bench quality measures its cost)",
            f"               {routing['assumption']}",
            f"               exact routing: {routing['exact_decode_tok_s']:.1f} tok/s, "
            f"{routing['exact_misses_per_token']:.0f} misses per token"]


def main(argv: Optional[List[str]] = None) -> int:
    args = setup_arg_parser().parse_args(argv)

    def body() -> int:
        result = predict(args)
        write_out(json.dumps(result, indent=1) if args.json else render(result), end="\n")
        return 0

    return run_main(body)


if __name__ == "__main__":
    leave(main())
