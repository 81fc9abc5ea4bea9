"""Time of the native step's bookkeeping (route and ensure) per layer call,
for several eviction policies on the same routing, rounds interleaved.

    python scripts/native_step_cost.py --model MODEL/stream --trace TRACE --slots 8

TRACE is a routing trace `bench cache` recorded (routing-trace-w4.jsonl);
its first layer's decode calls are replayed through layer 0's store.
"""

import argparse
import sys
import time

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--trace", required=True)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--policies", default="lfu-decay,adaptive")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    import mlx_streaming
    from mlx_streaming.bench.cache import decode_records

    calls = [c.ids.astype(np.uint32).ravel() for c in decode_records(args.trace)[0]]
    stores = {}
    for policy in args.policies.split(","):
        model, _ = mlx_streaming.load(args.model, slots_per_layer=args.slots, policy=policy)
        stores[policy] = (model, model.streaming.stores[0])
    times = {policy: [] for policy in stores}
    for _ in range(args.rounds):
        for policy, (_, store) in stores.items():
            start = time.perf_counter()
            for ids in calls:
                store.ensure(store.route(ids)[1])
            times[policy].append((time.perf_counter() - start) / len(calls) * 1e6)
    for policy, t in times.items():
        print(f"{policy}: {np.median(t):.2f} us per layer call (median of {args.rounds}; "
              f"{min(t):.2f}-{max(t):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
