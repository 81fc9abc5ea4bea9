"""How a slow disk's reads spread over decode: the share of the time with a
read in flight, and the rate while one is, against the rate over the run.

On a disk that serves reads one after another at its rate (a real SSD, or
``read_pace_mbps``) the rate while reading is that rate, less each read's
own overhead. A cgroup blkio throttle banks its
idle time instead: reads run at the device's speed on credit earned while
the model computed, and only the rate over the whole run is held to the
limit. That credit is the idle disk time prefetch exists to use, so
through a throttle prefetch off already overlaps its reads with compute.

    python scripts/disk_busy_share.py --model MODEL/stream --pace-mbps 550
    python scripts/disk_busy_share.py --model MODEL/stream --read-mbps 400   # root, cgroup v1

Prefetch off, direct I/O, 8 slots per layer by default (25% of a
32-expert model).
"""

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

import mlx_streaming
from mlx_streaming.bench.limits import ReadLimit
from mlx_streaming.errors import StreamingError

WARMUP = 8  # tokens that fill the pools, not counted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="stream directory")
    rate = p.add_mutually_exclusive_group(required=True)
    rate.add_argument("--pace-mbps", type=float, help="the reader emulates a disk of this rate")
    rate.add_argument("--read-mbps", type=float, help="a cgroup v1 blkio throttle of this rate")
    p.add_argument("--slots-per-layer", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64, help="decode tokens measured (1 or more)")
    p.add_argument("--temp", type=float, default=0.8)
    args = p.parse_args()
    if args.tokens < 1:
        p.error("--tokens must be 1 or more")
    if args.read_mbps is not None and args.read_mbps <= 0:
        p.error("--read-mbps must be above 0")
    try:
        measure(args)
    except StreamingError as e:  # a bad option or budget: its message says what to do
        sys.exit(f"disk_busy_share: {e}")


def measure(args) -> None:
    limit = None
    if args.read_mbps:
        limit = ReadLimit(args.read_mbps, Path(args.model))
        limit.enter()
    try:
        decode(args)
    finally:
        if limit is not None:
            limit.close()


def decode(args) -> None:
    model, tokenizer = mlx_streaming.load(args.model, slots_per_layer=args.slots_per_layer,
                                          direct_io=True, read_pace_mbps=args.pace_mbps)
    meter = model.streaming.reader.busy
    mx.random.seed(0)
    start = None
    for n, _ in enumerate(stream_generate(model, tokenizer, "def fibonacci(n):\n    ",
                                          max_tokens=WARMUP + args.tokens,
                                          sampler=make_sampler(temp=args.temp)), 1):
        if n == WARMUP:
            start = time.perf_counter(), meter()
    end = time.perf_counter(), meter()
    model.streaming.close()
    if start is None:
        sys.exit(f"disk_busy_share: the text ended within the {WARMUP} warm-up tokens; "
                 "nothing was measured")
    elapsed = end[0] - start[0]
    read, busy = (now - then for now, then in zip(end[1], start[1]))
    if not read:
        print(f"{n - WARMUP} tokens in {elapsed:.2f} s read nothing: every expert they "
              "routed to was resident (use fewer --slots-per-layer)")
        return
    print(f"{n - WARMUP} tokens in {elapsed:.2f} s: a read in flight {busy:.2f} s "
          f"({busy / elapsed:.0%}); {read / 1e9:.3f} GB read, {read / busy / 1e9:.3f} GB/s "
          f"while reading, {read / elapsed / 1e9:.3f} GB/s over the run")


if __name__ == "__main__":
    main()
