"""The routing statistics every benchmark number is reported with:
temporal reuse, top-8 traffic share and next-layer prediction recall,
measured by reading real text through the model."""

from pathlib import Path

from ..format import read_manifest
from .inputs import BenchError, routing_stats
from .runs import run_case


def measure(stream_dir: Path, out_dir: Path, tokens: int = 64, seed: int = 0) -> dict:
    """Routing statistics of ``stream_dir`` from ``tokens`` tokens of text.

    Recall is the share of a layer's routed experts that the next-layer
    prediction (the layer's router applied to the previous layer's input)
    named, within its top-k and within its top-2k.
    """
    spec = read_manifest(stream_dir).layers[0]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    result = {}
    for width in (spec.top_k, 2 * spec.top_k):
        trace = Path(out_dir) / f"routing-trace-w{width}.jsonl"
        case = dict(op="routing", kind="streaming", model=str(stream_dir), tokens=tokens,
                    seed=seed, load=dict(slots_per_layer=spec.num_experts, trace=str(trace),
                                         prefetch="next-layer", prefetch_width=width))
        r = run_case(case)
        if r["status"] != "ok":
            raise BenchError(f"routing measurement failed: {r.get('error', r['status'])}")
        result[f"next_layer_recall_top{width}"] = r["stats"]["total"]["prefetch_recall"]
        if width == spec.top_k:
            result.update(routing_stats(trace))
    result["top_k"] = spec.top_k
    result["num_experts"] = spec.num_experts
    return result


def describe(r: dict) -> str:
    k = r["top_k"]
    recall_k = r[f"next_layer_recall_top{k}"]
    recall_2k = r[f"next_layer_recall_top{2 * k}"]
    return (f"routing: reuse {r['temporal_reuse']:.0%} of the previous token's experts, "
            f"top-8 share {r['top8_share']:.2f}, next-layer recall {recall_k:.0%} "
            f"(top-{k}) / {recall_2k:.0%} (top-{2 * k})")
