"""bench serve: this package's server against mlx_lm.server on the same
weights fully resident, both started here, the same prompts, throughput,
time to first token and p50/p95 latency at each client count, interleaved
rounds, ratios to mlx-lm from the same run.

    python -m mlx_streaming.bench serve --model STREAM --mlx-model MLX --clients 1,4 --requests 8
"""

import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from ..format import read_manifest
from .common import BenchError, figure, finish, pool_slots
from ..flags import MAX_ROUNDS, MAX_TOKENS, count, listed, number

PROMPTS = ["def main(", "import os\n", "class Parser:", "for i in range(", "while True:",
           "# Read the file", "return self.", "if __name__ =="]

COLUMNS = [("server", "server", "s"), ("clients", "clients", "d"),
           ("tokens_per_s", "tok/s"), ("vs_mlx_lm", "vs mlx-lm", ".2f"),
           ("ttft_p50_s", "TTFT p50 s"), ("latency_p50_s", "latency p50 s"),
           ("latency_p95_s", "latency p95 s"), ("requests", "requests", "d")]


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="stream directory")
    p.add_argument("--mlx-model", required=True, help="the same weights as an mlx-lm model")
    p.add_argument("--pool", type=number(0, 1, open_low=True), default=0.25, help="share of experts resident")
    p.add_argument("--clients", type=listed(count(1, 64)), default="1,4", help="concurrent clients, comma-separated")
    p.add_argument("--requests", type=count(1, 100_000), default=8, help="requests per client count")
    p.add_argument("--max-tokens", type=count(1, MAX_TOKENS), default=32)
    p.add_argument("--rounds", type=count(1, MAX_ROUNDS), default=2, help="interleaved rounds (median kept)")
    p.add_argument("--out", type=Path, default=Path("bench-results/serve"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """A server started for the bench, stopped when it ends."""

    def __init__(self, command, port):
        self.url = f"http://127.0.0.1:{port}"
        # A file, not a pipe: a server logging per request would fill a pipe
        # nobody reads and block.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log,
                                     text=True)
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

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _one_request(url: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps(dict(prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                           stream_options={"include_usage": True})).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif first is None and event["choices"] and event["choices"][0].get("text"):
                first = time.perf_counter() - start
    return dict(latency=time.perf_counter() - start, ttft=first, tokens=tokens)


def _load_test(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` requests from ``clients`` threads; each request's prompt
    is fixed by its index, so both servers see the same ones."""
    results, lock, next_index = [], threading.Lock(), [0]

    def client():
        while True:
            with lock:
                i = next_index[0]
                next_index[0] += 1
            if i >= requests:
                return
            r = _one_request(url, PROMPTS[i % len(PROMPTS)] + f" # {i}", max_tokens)
            with lock:
                results.append(r)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latency = [r["latency"] for r in results]
    ttft = [r["ttft"] for r in results if r["ttft"] is not None]
    return dict(tokens_per_s=sum(r["tokens"] for r in results) / wall,
                ttft_p50_s=float(np.median(ttft)) if ttft else None,
                latency_p50_s=float(np.percentile(latency, 50)),
                latency_p95_s=float(np.percentile(latency, 95)), requests=len(results))


def run(args) -> dict:
    stream_dir = Path(args.model)
    manifest = read_manifest(stream_dir)
    slots = pool_slots(manifest.layers[0], args.pool)
    clients = args.clients
    queue = str(max(clients))
    ports = [_free_port(), _free_port()]
    servers = {
        f"mlx_streaming pool {slots}/{manifest.layers[0].num_experts}": [
            sys.executable, "-m", "mlx_streaming.server", "--model", str(stream_dir),
            "--slots-per-layer", str(slots), "--max-queue", queue, "--port", str(ports[0])],
        "mlx_lm.server resident": [
            sys.executable, "-m", "mlx_lm", "server", "--model", str(args.mlx_model),
            "--port", str(ports[1])],
    }
    running = {}
    try:
        for (name, command), port in zip(servers.items(), ports):
            running[name] = _Process(command, port)
        measured = {(n, c): [] for n in servers for c in clients}
        for _ in range(args.rounds):  # interleaved: slow spells hit both alike
            for c in clients:
                for name, proc in running.items():
                    measured[name, c].append(
                        _load_test(proc.url, c, args.requests, args.max_tokens))
    finally:
        for proc in running.values():
            proc.stop()
    rows = []
    for (name, c), runs in measured.items():
        best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        rows.append(dict(best, server=name, clients=c,
                         runs_tokens_per_s=[r["tokens_per_s"] for r in runs]))
    for row in rows:
        base = next(r for r in rows if r["clients"] == row["clients"]
                    and r["server"].startswith("mlx_lm"))
        row["vs_mlx_lm"] = row["tokens_per_s"] / base["tokens_per_s"]
    title = (f"bench serve: {args.requests} requests x {args.max_tokens} tokens per client "
             f"count, greedy, median of {args.rounds} interleaved rounds")
    result = dict(rows=rows, model=str(stream_dir), mlx_model=str(args.mlx_model),
                  pool=args.pool, slots_per_layer=slots)
    return finish(args.out, "serve", result, rows, COLUMNS, title, _plot)


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
        axes[1].bar(xs, [mine[c]["latency_p50_s"] for c in clients], width, label=name)
    for ax, label in zip(axes, ("tokens/s (all clients)", "latency p50 (s)")):
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(clients))],
                      [f"{c} clients" for c in clients])
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
