"""bench io: expert-read throughput and the decode value of prefetch.

1. Throughput: for several expert (record) sizes, read a blob's records in
   random order, ``--batch`` records per call (a layer's misses), with the
   native and the Python reader, buffered and direct (uncached), cold (page
   cache dropped) and warm; against ``dd`` with direct I/O on the same blob,
   measured in the same run.
2. With ``--model``: decode tok/s with prefetch off, on and auto, at each
   pool size, page cache dropped before each case.
"""

import time
from pathlib import Path

import numpy as np

from ..config import add_option_flag, config_options
from ..flags import MAX_ROUNDS, MAX_TOKENS, count, fractions, listed, number, size, temperature
from ..io.native import NativeReader, load_extension
from ..io.python import PythonReader, aligned_empty
from .inputs import BenchError, pool_slots
from .limits import disk_read_gbps, drop_page_cache
from .report import figure, print_table, save_json
from .runs import median_run, run_case


def add_arguments(p) -> None:
    p.add_argument("--dir", type=Path, default=Path("bench-results/io-blobs"),
                   help="where the test blobs are written (an SSD, not tmpfs)")
    p.add_argument("--sizes", type=listed(size(4096, 1 << 30, multiple=4096)), default="256K,1M,4M,16M")
    p.add_argument("--blob-gb", type=number(0, 1024, open_low=True), default=1.0)
    p.add_argument("--batch", type=count(1, 1024), default=8, help="records per read call")
    add_option_flag(p, "io_threads", "--io-threads", "--threads", note="the throughput readers")
    p.add_argument("--rounds", type=count(1, MAX_ROUNDS), default=3,
                   help="cold measurements per reader, interleaved with dd; medians reported")
    p.add_argument("--no-cold", action="store_true", help="skip cold reads (needs root)")
    p.add_argument("--no-throughput", action="store_true",
                   help="only the prefetch decode runs")
    p.add_argument("--model", help="stream directory for the prefetch decode runs")
    p.add_argument("--pools", type=fractions, default="0.25,0.5")
    add_option_flag(p, "prefetch_records", note="the decode runs")
    add_option_flag(p, "prefetch_width", note="the decode runs")
    p.add_argument("--repeats", type=count(1, MAX_ROUNDS), default=3,
                   help="rounds of the prefetch decode cases, interleaved; medians reported")
    p.add_argument("--temp", type=temperature, default=0.0,
                   help="sampling temperature of the decode runs (0: greedy)")
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=24)
    add_option_flag(p, "direct_io", note="the decode runs (on: every miss goes to the disk, "
                    "as when the blobs are far larger than memory)")
    p.add_argument("--out", type=Path, default=Path("bench-results/io"))


def make_blob(path: Path, nbytes: int) -> Path:
    if path.exists() and path.stat().st_size == nbytes:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = nbytes
        while left:
            n = min(left, 64 << 20)
            f.write(rng.bytes(n))
            left -= n
    return path


def read_throughput(reader, path: Path, stride: int, batch: int) -> float:
    """GB/s reading every record of ``path`` once, in random order."""
    count = path.stat().st_size // stride
    order = np.random.default_rng(1).permutation(count)
    f = reader.open(str(path))
    dst = aligned_empty(batch * stride)
    addresses = (dst.ctypes.data + np.arange(batch, dtype=np.int64) * stride).reshape(batch, 1)
    segments = np.array([[0, stride]], dtype=np.int64)
    start = time.perf_counter()
    for i in range(0, count, batch):
        ids = order[i : i + batch].astype(np.int64)
        reader.read(f, ids * stride, segments, addresses[: len(ids)],
                    np.zeros(len(ids), dtype=bool), stride)
    seconds = time.perf_counter() - start
    return count * stride / seconds / 1e9


def _readers(threads):
    ext, _ = load_extension()
    out = []
    for direct in (False, True):
        if ext is not None:
            out.append((f"native{' direct' if direct else ''}",
                        lambda d=direct: NativeReader(ext, threads, d)))
        out.append((f"python{' direct' if direct else ''}",
                    lambda d=direct: PythonReader(threads, d)))
    return out


def _cold(measure, *args) -> float:
    drop_page_cache()
    return measure(*args)


def throughput(args) -> list:
    """GB/s per record size and reader. Cold numbers are medians of
    ``--rounds`` rounds, each of which also times dd, so a shared disk's
    slow spells hit every reader alike."""
    from ..config import default_io_threads

    threads = args.io_threads or default_io_threads()
    readers = _readers(threads)
    rows = []
    for stride in args.sizes:
        name = f"{stride >> 20}M" if stride >= 1 << 20 else f"{stride >> 10}K"
        nbytes = int(args.blob_gb * 1e9) // stride * stride
        if nbytes < stride * args.batch:
            raise BenchError(f"--blob-gb {args.blob_gb:g} holds fewer than --batch "
                             f"{args.batch} records of {name}: give a larger --blob-gb")
        path = make_blob(args.dir / f"bench-io-{name}.blob", nbytes)
        row = dict(size=name, stride=stride, threads=threads)
        cold = {}
        for _ in range(0 if args.no_cold else args.rounds):
            cold.setdefault("dd_direct", []).append(
                _cold(disk_read_gbps, path, stride, nbytes))
            for label, make in readers:
                cold.setdefault(f"{label} cold", []).append(
                    _cold(_measure, make, path, stride, args.batch))
        row.update({k: float(np.median(v)) for k, v in cold.items()})
        for label, make in readers:
            reader = make()
            read_throughput(reader, path, stride, args.batch)  # fill the page cache
            row[f"{label} warm"] = read_throughput(reader, path, stride, args.batch)
            reader.close()
        if "dd_direct" in row:
            for label, _ in readers:
                row[f"{label} cold / dd"] = row[f"{label} cold"] / row["dd_direct"]
        rows.append(row)
    return rows


def _measure(make, path, stride, batch) -> float:
    reader = make()
    try:
        return read_throughput(reader, path, stride, batch)
    finally:
        reader.close()


def checksum_throughput(nbytes: int = 256 << 20) -> dict:
    """GB/s of the CRC-32 that checks each expert on its first read."""
    import zlib

    data = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    out = {}
    ext, _ = load_extension()
    for name, crc in (("zlib", zlib.crc32), ("native", ext.crc32 if ext else None)):
        if crc is None:
            continue
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            crc(data)
            best = min(best, time.perf_counter() - start)
        out[f"crc32_{name}_gbps"] = nbytes / best / 1e9
    return out


def prefetch_decode(args) -> list:
    """Decode with prefetch off, on and auto at each pool size, cold; the
    cases of a pool size run in interleaved rounds and report medians."""
    from ..format import read_manifest

    spec = read_manifest(args.model).layers[0]
    rows = []
    for pool in args.pools:
        slots = pool_slots(spec, pool)
        modes = ("off", "next-layer", "auto")
        runs = {m: [] for m in modes}
        for _ in range(args.repeats):
            for prefetch in modes:
                case = dict(op="decode", kind="streaming", model=str(args.model),
                            max_tokens=args.max_tokens, prompt_tokens=16, temp=args.temp,
                            load=dict(config_options(args, ["prefetch_width",
                                                            "prefetch_records", "direct_io"]),
                                      slots_per_layer=slots, prefetch=prefetch))
                runs[prefetch].append(run_case(case, cold=not args.no_cold))
        for prefetch in modes:
            rows.append(_prefetch_row(runs[prefetch], slots / spec.num_experts, prefetch))
        off = rows[-3].get("decode_tps")
        for r in rows[-3:]:
            if off and r.get("decode_tps"):
                r["vs_off"] = r["decode_tps"] / off
    return rows


def _prefetch_row(results, pool, prefetch) -> dict:
    r = median_run(results)
    row = dict(pool=pool, prefetch=prefetch, status=r["status"],
               runs_tps=[x.get("decode_tps") for x in results])
    if r["status"] != "ok":
        return row
    t = r["stats"]["total"]
    row.update(decode_tps=r["decode_tps"], hit_rate=t["hit_rate"],
               stall_share=t["stall_seconds"] / r["decode_s"], recall=t["prefetch_recall"],
               issued=t["prefetch_issued"], useful=t["prefetch_useful"],
               wasted=t["prefetch_wasted"], syncs_per_token=t["syncs"] / r["decode_tokens"],
               decision=r["stats"]["prefetch_decision"])
    return row


def run(args) -> dict:
    result = dict(batch=args.batch, blob_gb=args.blob_gb)
    rows = [] if args.no_throughput else throughput(args)
    if rows:
        keys = [k for k in rows[0] if k not in ("size", "stride", "threads")]
        columns = [("size", "record", "s")] + [(k, k, ".2f") for k in keys]
        result["throughput"] = rows
        result["checksum"] = checksum_throughput()
        print("first-read checksum GB/s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in result["checksum"].items()))
        result["throughput_table"] = print_table(
            rows, columns, f"bench io: expert reads, GB/s, {args.batch} records per call, "
                           f"{rows[0]['threads']} threads")
    if args.model:
        decode_rows = prefetch_decode(args)
        result["prefetch_decode"] = decode_rows
        result["prefetch_table"] = print_table(decode_rows, [
            ("pool", "pool", ".0%"), ("prefetch", "prefetch", "s"), ("decode_tps", "tok/s", ".3g"),
            ("vs_off", "x off", ".2f"), ("hit_rate", "hit", ".0%"), ("stall_share", "stall", ".0%"),
            ("recall", "recall", ".0%"), ("issued", "issued", "d"), ("useful", "useful", "d"),
            ("syncs_per_token", "syncs/tok", ".1f"), ("decision", "decision", "s")],
            "bench io: decode with prefetch, page cache dropped before each case"
            + f", direct I/O {args.direct_io or 'auto'}")
        from . import routing

        result["routing"] = routing.measure(Path(args.model), args.out)
        print(routing.describe(result["routing"]))
    save_json(args.out / "io.json", result)
    if rows:
        _plot(rows, args.out / "io.png")
    return result


def _plot(rows, path):
    plt = figure()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    keys = [k for k in rows[0] if k not in ("size", "stride", "threads") and "/" not in k]
    width = 0.8 / len(keys)
    for i, k in enumerate(keys):
        ax.bar([j + i * width for j in range(len(rows))], [r.get(k, 0) for r in rows], width,
               label=k)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["size"] for r in rows])
    ax.set_xlabel("record size")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
