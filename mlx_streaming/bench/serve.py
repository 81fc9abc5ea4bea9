"""bench serve: this package's server, one request at a time (serial) and
decoding requests together (batched), against mlx_lm.server on the same
weights fully resident (batching too), all started here; 1, 2, 4 and 8
concurrent clients of one API (``--api``: OpenAI, Ollama or Anthropic),
each request with a prompt of its own. Reports total tok/s, time to first
token and inter-token latency (p50, p95), our servers' expert hit rate and
MB read per generated token, in interleaved rounds, with ratios to the
serial server and to mlx-lm from the same run. ``--agent-turns N`` also
times an agent's warm second turn against its cold first one on a system
prompt of N words.

    python -m mlx_streaming.bench serve --model STREAM --mlx-model MLX [--read-mbps 50]
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ..flags import MAX_ROUNDS, MAX_TOKENS, count, listed, number
from ..format import read_manifest
from .clients import APIS, streamed
from .inputs import BenchError, add_read_rate_flags, pool_slots
from .limits import ReadLimit
from .quality import equal_memory_slots, setting_options
from .report import figure, finish, print_table

# A different prompt per request: clients share no prompt cache.
PROMPTS = ["def main(", "import os\n", "class Parser:", "for i in range(", "while True:",
           "# Read the file", "return self.", "if __name__ ==", "with open(", "try:\n",
           "@property\ndef ", "from typing import", "async def fetch(", "raise ValueError(",
           "lambda x:", "yield from"]

COLUMNS = [("server", "server", "s"), ("clients", "clients", "d"),
           ("tokens_per_s", "tok/s"), ("vs_serial", "x serial", ".2f"),
           ("vs_mlx_lm", "x mlx-lm", ".2f"), ("ttft_p50_s", "TTFT p50 s"),
           ("ttft_p95_s", "TTFT p95 s"), ("itl_p50_s", "ITL p50 s"), ("itl_p95_s", "ITL p95 s"),
           ("hit_rate", "hit", ".0%"), ("mb_read_per_token", "MB read/tok", ".3g"),
           ("requests", "requests", "d")]
CASES = ("serial", "batched", "mlx-lm")
CASE_FORMS = "serial, batched or mlx-lm; serial+SETTING or batched+SETTING"


def serve_case(text: str) -> str:
    """A ``--cases`` entry: a case, or ours with an approximate setting of
    bench quality's (``batched+cache-aware:3:8``; checked against the
    model when the bench starts)."""
    case, plus, setting = text.partition("+")
    if case not in CASES or (plus and (case == "mlx-lm" or not setting)):
        raise argparse.ArgumentTypeError(f"must be {CASE_FORMS}, got {text!r}")
    if setting == "exact":
        raise argparse.ArgumentTypeError(f"{case} is exact already, got {text!r}")
    return text


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--mlx-model", help="the same weights as an mlx-lm model (the mlx-lm case)")
    p.add_argument("--pool", type=number(0, 1, open_low=True), default=0.25,
                   help="share of experts resident")
    p.add_argument("--clients", type=listed(count(1, 64)), default="1,2,4,8",
                   help="concurrent clients, comma-separated")
    p.add_argument("--requests", type=count(1, 100_000), default=16,
                   help="requests per client count, each with a prompt of its own")
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=32)
    p.add_argument("--rounds", type=count(1, MAX_ROUNDS), default=2,
                   help="interleaved rounds (median kept)")
    p.add_argument("--cases", type=listed(serve_case), default=",".join(CASES),
                   help="serial (one request at a time), batched (decoded together), mlx-lm "
                        "(mlx_lm.server on the resident model, batching); serial+SETTING or "
                        "batched+SETTING run ours with an approximate setting of bench "
                        "quality's (batched+cache-aware:3:8)")
    p.add_argument("--decode-concurrency", type=count(1, 64), default=8,
                   help="sequences decoded together in the batched cases")
    add_read_rate_flags(p, "our servers'", pace=False)
    p.add_argument("--api", choices=APIS, default="openai",
                   help="the API the clients speak (mlx-lm's server speaks OpenAI's only): "
                        "OpenAI completions, Ollama's /api/generate raw, or Anthropic's "
                        "messages (one user turn, through the chat template)")
    p.add_argument("--agent-turns", type=count(0, 100_000), default=0, metavar="WORDS",
                   help="also time an agent's two turns on a system prompt of WORDS words, "
                        "new each round: the first turn's time to first token (cold) against "
                        "the second's, which extends it (warm: mlx-lm's prompt cache); 0: off")
    p.add_argument("--out", type=Path, default=Path("bench-results/serve"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """A server started for the bench (in ``limit``'s cgroup, if any),
    stopped when it ends."""

    def __init__(self, command, port, limit=None):
        self.url = f"http://127.0.0.1:{port}"
        # A file, not a pipe: a server logging per request would fill a pipe
        # nobody reads and block.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log,
                                     text=True, preexec_fn=limit.enter if limit else None)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise BenchError(f"server {command[2]} exited: {self.log.read()[-500:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise BenchError(f"server {command[2]} did not start within 300 s")

    def counters(self) -> Optional[dict]:
        """Our server's expert counters so far (None for mlx-lm's)."""
        try:
            with urllib.request.urlopen(self.url + "/v1/stats", timeout=30) as r:
                return json.loads(r.read())["streaming"]["total"]
        except OSError:
            return None

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _load_test(url: str, clients: int, requests: int, max_tokens: int,
               api: str = "openai") -> dict:
    """``requests`` requests from ``clients`` threads, each request with its
    own prompt (fixed by its index, so every server sees the same ones)."""
    results, lock, next_index = [], threading.Lock(), [0]

    def client_thread():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= requests:
                return
            r = streamed(url, api, max_tokens, prompt=PROMPTS[i % len(PROMPTS)] + f" # {i}")
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_thread) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return dict(tokens_per_s=sum(r["tokens"] for r in results) / wall,
                tokens=sum(r["tokens"] for r in results),
                ttft_p50_s=pct(ttft, 50), ttft_p95_s=pct(ttft, 95),
                itl_p50_s=pct(gaps, 50), itl_p95_s=pct(gaps, 95),
                latency_p95_s=pct([r["latency"] for r in results], 95), requests=len(results))


def _measure(proc: "_Process", clients: int, args) -> dict:
    """A load test, with our server's hit rate and bytes read per generated
    token over it."""
    before = proc.counters()
    row = _load_test(proc.url, clients, args.requests, args.max_tokens, args.api)
    after = proc.counters()
    if before is not None and after is not None:
        hits = after["hits"] - before["hits"]
        lookups = hits + after["misses"] - before["misses"]
        row["hit_rate"] = hits / lookups if lookups else None
        row["mb_read_per_token"] = ((after["bytes_read"] - before["bytes_read"]) / 1e6
                                    / max(1, row["tokens"]))
    return row


def _servers(args, slots: int, manifest) -> Dict[str, tuple]:
    """``{label: (case, command)}`` of each of ``--cases`` (its text, as
    ``batched+cache-aware:3:8``), on a port of its own."""
    spec = manifest.layers[0]
    if len(set(args.cases)) != len(args.cases):
        raise BenchError("--cases names a case twice")
    if "mlx-lm" in args.cases and not args.mlx_model:
        raise BenchError("the mlx-lm case needs --mlx-model (or leave it out of --cases)")
    if "mlx-lm" in args.cases and args.api != "openai":
        raise BenchError(f"mlx_lm.server speaks only the OpenAI API: leave mlx-lm out of "
                         f"--cases with --api {args.api}")
    concurrency = {"serial": "1", "batched": str(args.decode_concurrency)}
    servers = {}
    for case in args.cases:
        kind, _, setting = case.partition("+")
        if kind == "mlx-lm":
            servers["mlx_lm.server resident"] = (case, [
                sys.executable, "-m", "mlx_lm", "server", "--model", str(args.mlx_model),
                "--decode-concurrency", str(args.decode_concurrency)])
            continue
        options = setting_options(setting, spec.top_k, spec.num_experts,
                                  f"--cases {case}") if setting else {}
        # As in bench quality: the low-bit copies' pool comes out of the pool.
        pool = equal_memory_slots(manifest, slots, options.get("miss_bits"), f"--cases {case}")
        command = [sys.executable, "-m", "mlx_streaming.server", "--model", str(args.model),
                   "--slots-per-layer", str(pool), "--max-queue", str(max(args.clients)),
                   "--decode-concurrency", concurrency[kind]]
        if args.read_mbps:
            command += ["--direct-io", "on"]  # the page cache would hide the throttle
        command += [flag for key, value in options.items()
                    for flag in (f"--{key.replace('_', '-')}", str(value))]
        label = f"mlx_streaming pool {pool}/{spec.num_experts} {kind}" + \
            (f", {setting}" if setting else "")
        servers[label] = (case, command)
    return {label: (case, command + ["--port", str(_free_port())])
            for label, (case, command) in servers.items()}


def run(args) -> dict:
    stream_dir = Path(args.model)
    manifest = read_manifest(stream_dir)
    spec = manifest.layers[0]
    slots = pool_slots(spec, args.pool)
    servers = _servers(args, slots, manifest)
    running, throttle = {}, None
    try:
        if args.read_mbps:
            throttle = ReadLimit(args.read_mbps, stream_dir)
        for name, (case, command) in servers.items():
            ours = case != "mlx-lm"
            running[name] = _Process(command, int(command[-1]), throttle if ours else None)
        measured = {(n, c): [] for n in servers for c in args.clients}
        turns = {n: [] for n in servers if args.agent_turns and servers[n][0] != "mlx-lm"}
        for r in range(args.rounds):  # interleaved: slow spells hit every case alike
            for c in args.clients:
                for name, proc in running.items():
                    measured[name, c].append(_measure(proc, c, args))
            for name in turns:
                turns[name].append(agent_turns(running[name].url, args, f"{r}"))
    finally:
        for proc in running.values():
            proc.stop()
        if throttle is not None:
            throttle.close()
    rows = _rows(measured, {name: case for name, (case, _) in servers.items()})
    title = (f"bench serve: {args.requests} requests x {args.max_tokens} tokens per client "
             f"count, greedy, median of {args.rounds} interleaved rounds"
             + (f", our servers' reads throttled to {args.read_mbps:g} MB/s"
                if args.read_mbps else ", page cache warm"))
    result = dict(rows=rows, model=str(stream_dir), mlx_model=str(args.mlx_model),
                  pool=args.pool, slots_per_layer=slots, read_mbps=args.read_mbps,
                  decode_concurrency=args.decode_concurrency, api=args.api)
    if turns:
        result["agent_turns"] = _turn_rows(turns)
        print_table(result["agent_turns"], TURN_COLUMNS,
                    f"agent turns through {args.api}: a system prompt of {args.agent_turns} "
                    f"words, greedy, median of {args.rounds} rounds")
    return finish(args.out, "serve", result, rows, COLUMNS, title, _plot)


TURN_COLUMNS = [("server", "server", "s"), ("cold_ttft_s", "cold TTFT s"),
                ("warm_ttft_s", "warm TTFT s"), ("warm_vs_cold", "warm / cold", ".3f")]


def agent_turns(url: str, args, nonce: str) -> dict:
    """An agent's two turns on a long system prompt new to the server
    (``nonce``): the first turn's time to first token (cold: the whole
    prompt is read) and the second's, which extends the first."""
    words = (" ".join(PROMPTS) + " ").split()
    system = f"Session {nonce}-{time.time_ns()}. " + " ".join(
        words[i % len(words)] for i in range(args.agent_turns))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Write a function."}]
    first = streamed(url, args.api, args.max_tokens, messages=messages)
    messages += [{"role": "assistant", "content": first["text"]},
                 {"role": "user", "content": "Now test it."}]
    second = streamed(url, args.api, args.max_tokens, messages=messages)
    return dict(cold_ttft_s=first["ttft"], warm_ttft_s=second["ttft"])


def _turn_rows(turns: Dict[str, list]) -> List[dict]:
    """Per server, the median cold and warm times to first token, and the
    median of each round's warm / cold ratio (paired)."""
    rows = []
    for name, runs in turns.items():
        ok = [r for r in runs if r["cold_ttft_s"] and r["warm_ttft_s"]]
        median = lambda xs: float(np.median(xs)) if xs else None  # noqa: E731
        rows.append(dict(server=name, cold_ttft_s=median([r["cold_ttft_s"] for r in ok]),
                         warm_ttft_s=median([r["warm_ttft_s"] for r in ok]),
                         warm_vs_cold=median([r["warm_ttft_s"] / r["cold_ttft_s"] for r in ok]),
                         runs=runs))
    return rows


def _rows(measured, cases: Dict[str, str]) -> List[dict]:
    """The median round of each (server, clients), with its ratios to the
    exact serial server and to mlx-lm's at the same client count."""
    rows = []
    for (name, c), runs in measured.items():
        middle = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        rows.append(dict(middle, server=name, clients=c, case=cases[name],
                         runs_tokens_per_s=[r["tokens_per_s"] for r in runs]))
    for row in rows:
        for key, case in (("vs_serial", "serial"), ("vs_mlx_lm", "mlx-lm")):
            base = next((r for r in rows if r["clients"] == row["clients"]
                         and r["case"] == case), None)
            row[key] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
    return rows


def _plot(rows, path, title):
    plt = figure()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = sorted({r["server"] for r in rows})
    clients = sorted({r["clients"] for r in rows})
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        mine = {r["clients"]: r for r in rows if r["server"] == name}
        xs = [i + k * width for i in range(len(clients))]
        axes[0].bar(xs, [mine[c]["tokens_per_s"] for c in clients], width, label=name)
        axes[1].bar(xs, [mine[c]["ttft_p95_s"] or 0 for c in clients], width, label=name)
    for ax, label in zip(axes, ("tokens/s (all clients)", "time to first token p95 (s)")):
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(clients))],
                      [f"{c} clients" for c in clients])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
