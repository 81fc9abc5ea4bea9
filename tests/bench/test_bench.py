"""The measuring instruments: policy replay is right (it agrees with the
live pool, Belady is optimal) and every bench subcommand runs end to end,
writing its JSON and plot. Speed itself is never asserted here."""

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_streaming
from mlx_streaming.bench import cache as bench_cache
from mlx_streaming.bench.__main__ import main as bench_main
from mlx_streaming.bench.inputs import BenchError, routing_stats
from mlx_streaming.bench.speculative import expected_tokens
from mlx_streaming.config import POLICY_CHOICES
from mlx_streaming.runtime.policy import ARC, LFU, LRU, DecayedLFU, RouterEMA, make_policy


@pytest.mark.parametrize("policy", POLICY_CHOICES)
def test_policy_replay_matches_the_live_pool(models, tmp_path, policy):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    trace = tmp_path / "trace.jsonl"
    with mlx_streaming.load(stream_dir, slots_per_layer=6, trace=str(trace),
                            policy=policy) as (model, tok):
        cache = make_prompt_cache(model)
        for t in tok.encode("def replay(trace):\n    return [line for line in trace]\n"):
            mx.eval(model(mx.array([[t]]), cache=cache))
        live = mlx_streaming.stats(model)["layers"]
    for layer, calls in bench_cache.decode_records(trace).items():
        simulated = bench_cache.simulate(calls, 6, make_policy(policy, calls[0].probs.shape[-1]))
        assert simulated == pytest.approx(live[layer]["hit_rate"])


def test_belady_is_never_beaten():
    rng = np.random.default_rng(0)
    for _ in range(5):
        calls = [np.unique(rng.zipf(1.5, size=3) % 20) for _ in range(300)]
        for capacity in (3, 6, 10):
            rates = bench_cache.replay(calls, capacity, 20)
            assert rates["belady"] >= max(rates.values()) - 1e-12
            assert rates["belady"] >= rates["lookahead16"] - 1e-12


def test_lfu_keeps_the_frequent_expert():
    calls = [np.array([0]), np.array([0]), np.array([1]), np.array([2]), np.array([0])]
    assert bench_cache.simulate(calls, 2, LFU(3)) == pytest.approx(2 / 5)
    assert bench_cache.simulate(calls, 2, LRU(3)) == pytest.approx(1 / 5)
    # Decayed counts remember expert 0 across its eviction; in-cache LFU forgets.
    calls = [np.array([0])] * 3 + [np.array([1]), np.array([2]), np.array([0])]
    assert bench_cache.simulate(calls, 2, DecayedLFU(3, 32)) == pytest.approx(3 / 6)


def test_arc_and_router_policies_replay():
    rng = np.random.default_rng(1)
    probs = rng.dirichlet(np.ones(12), size=200)
    calls = [bench_cache.Call(np.sort(np.argsort(-p)[:2]), np.argsort(-p)[:2][None], p[None])
             for p in probs]
    for policy in (ARC(12), RouterEMA(12, 8), RouterEMA(12, 8, chosen_only=True)):
        rate = bench_cache.simulate(calls, 4, policy)
        assert 0 < rate <= bench_cache.simulate(calls, 4, bench_cache.Belady(calls, 12))


def test_global_allocation_gives_slots_where_they_gain_most():
    curves = [np.array([0, 5, 9, 10, 10]), np.array([0, 2, 4, 6, 8])]
    assert bench_cache.allocate(curves, 5, [1, 1]) == [2, 3]
    # A layer that repeats one expert needs one slot; the other gets the rest.
    calls = {0: [np.array([0])] * 40, 1: [np.array([i % 3]) for i in range(40)]}
    calls = {layer: bench_cache._as_calls(c) for layer, c in calls.items()}
    assert bench_cache.global_allocation(calls, 2, 4, lambda: LRU(4)) > \
        np.mean([bench_cache.simulate(c, 2, LRU(4)) for c in calls.values()])


def test_expected_tokens_of_a_verify_call():
    assert expected_tokens(1, 0.5) == pytest.approx(1.5)
    assert expected_tokens(3, 0.9) == pytest.approx(1 + 0.9 + 0.81 + 0.729)


def test_routing_stats_of_a_known_trace(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [{"layer": 0, "ids": [[0, 1]]}, {"layer": 0, "ids": [[1, 2]]},
             {"layer": 0, "ids": [[1, 2]]}, {"layer": 0, "ids": [[3, 4], [5, 6]]}]
    trace.write_text("".join(json.dumps(record) + "\n" for record in lines))
    r = routing_stats(trace, top=1)
    assert r["temporal_reuse"] == pytest.approx((0.5 + 1.0) / 2)
    assert r["top8_share"] == pytest.approx(3 / 6)  # expert 1: 3 of 6 uses


def _run(argv, out):
    assert bench_main(argv + ["--out", str(out)]) == 0


def test_bench_decode_records_what_the_others_replay(models, tmp_path, capsys):
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    common = ["--model", str(stream_dir)]
    _run(["decode", *common, "--mlx-model", str(src), "--pools", "0.25,1.0", "--max-tokens",
          "4", "--routing-tokens", "8"], tmp_path / "decode")
    # A line per case as it finishes, on stderr (the table is on stdout).
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench: decode")]
    # Four cases, and the run that records the trace Belady's MIN replays.
    assert len(progress) == 5 and all(": ok in " in line for line in progress)
    assert "slots_per_layer=" in progress[2]
    # The decode trace (Belady's replay, simulate's) holds the predictions
    # that simulate's prefetch cases replay.
    records = [json.loads(record) for record in (tmp_path / "decode" / "decode-trace.jsonl").open()]
    assert any("predicted" in r for r in records)
    # Two layers ahead too (the third MoE layer, from the first's input),
    # with the scores the calibration bins.
    assert any("predicted2" in r for r in records)
    for r in records:
        for key in ("predicted", "predicted2"):
            if key in r:
                assert np.shape(r[key + "_scores"]) == np.shape(r[key])
    d = json.loads((tmp_path / "decode" / "decode.json").read_text())
    cases = [r["case"] for r in d["rows"]]
    assert cases == ["(a) mlx-lm resident", "(b) mlx-lm lazy", "(c) mlx_streaming",
                     "(c) mlx_streaming"]
    assert all(r["status"] == "ok" for r in d["rows"])
    assert d["rows"][2]["bound_overlap_tps"] >= d["rows"][2]["bound_serial_tps"]
    assert {"temporal_reuse", "top8_share", "next_layer_recall_top4"} <= set(d["routing"])
    assert (tmp_path / "decode" / "decode.png").stat().st_size > 0


def test_bench_cache_replays_beside_belady(models, tmp_path):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    common = ["--model", str(stream_dir)]
    _run(["cache", *common, "--tokens", "24", "--capacities", "0.25,0.5"], tmp_path / "cache")
    c = json.loads((tmp_path / "cache" / "cache.json").read_text())
    assert all(r["belady"] >= r["lru"] for r in c["rows"])


def test_bench_speculative_and_prefill(models, tmp_path):
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    common = ["--model", str(stream_dir)]
    _run(["speculative", *common, "--mlx-model", str(src), "--max-k", "3", "--repeats", "2"],
         tmp_path / "speculative")
    v = json.loads((tmp_path / "speculative" / "speculative.json").read_text())
    streamed = [r for r in v["rows"] if r["case"].startswith("streaming")]
    assert [r["k"] for r in streamed] == [1, 2, 3]
    # The union of a verify call's experts grows with K.
    assert streamed[2]["experts_per_layer"] >= streamed[0]["experts_per_layer"]

    _run(["prefill", *common, "--mlx-model", str(src), "--lengths", "16,64"],
         tmp_path / "prefill")
    p = json.loads((tmp_path / "prefill" / "prefill.json").read_text())
    assert [r["tokens"] for r in p["rows"]] == [16, 64, 16, 64]


def test_bench_io_runs_warm(models, tmp_path):
    _run(["io", "--dir", str(tmp_path / "blobs"), "--sizes", "256K", "--blob-gb", "0.005",
          "--no-cold"], tmp_path / "io")
    r = json.loads((tmp_path / "io" / "io.json").read_text())["throughput"][0]
    assert r["python warm"] > 0 and r["native warm"] > 0


def test_bench_io_prefetch_decode_runs(models, tmp_path):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    _run(["io", "--no-throughput", "--no-cold", "--model", str(stream_dir), "--pools", "0.5",
          "--prefetch-records", "8",
          "--max-tokens", "4", "--repeats", "1"], tmp_path / "io")
    rows = json.loads((tmp_path / "io" / "io.json").read_text())["prefetch_decode"]
    assert [r["prefetch"] for r in rows] == ["off", "next-layer", "auto"]
    assert all(r["status"] == "ok" for r in rows)
    off, on = rows[0], rows[1]
    assert off["issued"] == 0 and on["issued"] > 0
    # Without prefetch decode calls run inside the graph (no sync); prefetch
    # adds no host sync of its own to the synced call: one per MoE layer.
    layers = len(mlx_streaming.format.read_manifest(stream_dir).layers)
    assert off["syncs_per_token"] == 0
    assert on["syncs_per_token"] == layers


def test_bench_quality_measures_each_setting_against_exact(models, tmp_path):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    text = tmp_path / "text.txt"
    text.write_text("def read(path):\n    with open(path) as f:\n        return f.read()\n" * 20)
    _run(["quality", "--model", str(stream_dir), "--text", str(text), "--tokens", "48",
          "--settings", "cache-aware:1:8:100,cache-aware:2:8:0.5", "--pace-mbps", "1000"],
         tmp_path / "q")
    result = json.loads((tmp_path / "q" / "quality.json").read_text())
    exact, ca, bonus = result["rows"]
    assert [r["status"] for r in result["rows"]] == ["ok"] * 3
    assert exact["kl"] == 0 and exact["top1_agreement"] == 1 and exact["ppl_change"] == 0
    assert exact["route_agreement"] == 1
    assert ca["kl"] >= 0 and ca["route_agreement"] < 1 and ca["hit_rate"] > exact["hit_rate"]
    assert ca["mb_per_token"] < exact["mb_per_token"]
    assert bonus["route_agreement"] >= ca["route_agreement"]
    assert all(r["speedup"] for r in result["rows"])
    assert (tmp_path / "q" / "quality.png").exists()


def test_bench_quality_decodes_streams_together(models, tmp_path):
    """--batch 2: the text cut in two streams, one token of each per call;
    exact's perplexity is mlx-lm's on the resident model decoding the same
    two streams together."""
    import mlx_lm

    src, stream_dir = models.get("qwen3_moe", quantized=True)
    text = tmp_path / "text.txt"
    text.write_text("def read(path):\n    with open(path) as f:\n        return f.read()\n" * 20)
    _run(["quality", "--model", str(stream_dir), "--text", str(text), "--tokens", "48",
          "--batch", "2", "--settings", "cache-aware:1:8"], tmp_path / "q")
    result = json.loads((tmp_path / "q" / "quality.json").read_text())
    exact, ca = result["rows"]
    assert result["batch"] == 2 and exact["status"] == ca["status"] == "ok"
    model, tokenizer = mlx_lm.load(str(src))
    streams = np.array(tokenizer.encode(text.read_text())[:48]).reshape(2, 24)
    cache, nll = make_prompt_cache(model), []
    for i in range(23):
        logits = model(mx.array(streams[:, i : i + 1]), cache=cache)[:, -1].astype(mx.float32)
        logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        nll.extend(-logp[np.arange(2), streams[:, i + 1]])
    assert exact["ppl"] == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-6)
    assert ca["route_agreement"] < 1 and ca["mb_per_token"] < exact["mb_per_token"]


@pytest.mark.parametrize("settings", ["cache-aware:9:8", "top-k-cut:4", "fast",
                                      "cache-aware:1:x", "cache-aware:1:8:-1",
                                      "exact,cache-aware,cache-aware"])
def test_bench_quality_refuses_a_setting_it_cannot_run(models, tmp_path, capsys, settings):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    assert bench_main(["quality", "--model", str(stream_dir), "--settings", settings,
                       "--out", str(tmp_path / "q")]) == 1
    assert "--settings" in capsys.readouterr().err


def test_bench_serve_compares_serial_batched_and_mlx_lm(models, tmp_path):
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    _run(["serve", "--model", str(stream_dir), "--mlx-model", str(src), "--clients", "1,2",
          "--requests", "2", "--max-tokens", "4", "--rounds", "1", "--cases",
          "serial,batched,mlx-lm,batched+cache-aware:1:8"], tmp_path / "serve")
    rows = json.loads((tmp_path / "serve" / "serve.json").read_text())["rows"]
    assert sorted((r["server"].split()[0], r["server"].split()[-1], r["clients"])
                  for r in rows) == [
        ("mlx_lm.server", "resident", 1), ("mlx_lm.server", "resident", 2),
        ("mlx_streaming", "batched", 1), ("mlx_streaming", "batched", 2),
        ("mlx_streaming", "cache-aware:1:8", 1), ("mlx_streaming", "cache-aware:1:8", 2),
        ("mlx_streaming", "serial", 1), ("mlx_streaming", "serial", 2)]
    routed = [r for r in rows if r["case"] == "batched+cache-aware:1:8"]
    serial = {r["clients"]: r["tokens_per_s"] for r in rows if r["case"] == "serial"}
    assert [r["vs_serial"] for r in routed] == [r["tokens_per_s"] / serial[r["clients"]]
                                                for r in routed]
    assert all(r["requests"] == 2 and r["tokens_per_s"] > 0 and r["ttft_p50_s"] > 0
               and r["itl_p95_s"] > 0 and r["vs_mlx_lm"] > 0 for r in rows)
    ours = [r for r in rows if r["server"].startswith("mlx_streaming")]
    assert all(r["mb_read_per_token"] >= 0 and 0 <= r["hit_rate"] <= 1 for r in ours)
    assert (tmp_path / "serve" / "serve.png").exists()


def test_bench_serve_starts_each_case_with_its_setting(models):
    """A ``+SETTING`` case's server gets the setting's flags (with low-bit
    copies, its pool: tests/conversion/test_low_bits.py)."""
    import argparse

    from mlx_streaming.bench import serve

    _, stream_dir = models.get("qwen3_moe", quantized=True)
    manifest = mlx_streaming.format.read_manifest(stream_dir)
    args = argparse.Namespace(model=stream_dir, mlx_model=None, clients=[1, 4],
                              decode_concurrency=8, read_mbps=None,
                              cases=["serial", "batched+cache-aware:1:8"])
    servers = serve._servers(args, 6, manifest)
    (serial, (_, plain)), (routed, (case, flags)) = servers.items()
    assert serial.endswith("pool 6/16 serial") and case == "batched+cache-aware:1:8"
    assert "--routing" not in plain and plain[plain.index("--decode-concurrency") + 1] == "1"
    assert flags[flags.index("--routing") + 1] == "cache-aware"
    assert flags[flags.index("--routing-keep") + 1] == "1"
    assert flags[flags.index("--routing-window") + 1] == "8"
    assert flags[flags.index("--decode-concurrency") + 1] == "8"
    args.cases = ["serial", "serial"]
    with pytest.raises(BenchError, match="names a case twice"):
        serve._servers(args, 6, manifest)
    args.cases, args.mlx_model, args.api = ["mlx-lm"], stream_dir, "anthropic"
    with pytest.raises(BenchError, match="speaks only the OpenAI API"):
        serve._servers(args, 6, manifest)


def test_bench_decode_compares_policies_and_prefetch_under_a_read_limit(models, tmp_path):
    # cgroup v1 blkio throttles this test's reads (root, as in CI).
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    _run(["decode", "--model", str(stream_dir), "--mlx-model", str(src), "--pools", "0.25",
          "--policies", "lru,lfu-decay", "--prefetch", "off,next-layer", "--direct-io", "on",
          "--read-mbps", "50", "--max-tokens", "4", "--routing-tokens", "8"], tmp_path / "d")
    d = json.loads((tmp_path / "d" / "decode.json").read_text())
    streamed = [r for r in d["rows"] if r["case"].startswith("(c)")]
    assert [r["case"] for r in streamed] == [
        f"(c) mlx_streaming policy={p} prefetch={f}"
        for p in ("lru", "lfu-decay") for f in ("off", "next-layer")]
    assert all(r["status"] == "ok" and r["vs_belady"] > 0 for r in streamed)
    assert d["read_mbps"] == 50
    assert all(r["belady_gb_per_token"] >= 0 and r["belady_serial_tps"] > 0 for r in streamed)

    # The reader's own pacing instead: the cases load with it, and the
    # bounds are taken at its rate.
    _run(["decode", "--model", str(stream_dir), "--mlx-model", str(src), "--pools", "0.25",
          "--direct-io", "on", "--pace-mbps", "50", "--max-tokens", "4",
          "--routing-tokens", "8"], tmp_path / "p")
    d = json.loads((tmp_path / "p" / "decode.json").read_text())
    (paced,) = [r for r in d["rows"] if r["case"].startswith("(c)")]
    assert paced["status"] == "ok" and paced["load"]["read_pace_mbps"] == 50
    assert d["pace_mbps"] == 50 and d["read_mbps"] is None
    compute = 1 / d["rows"][0]["decode_tps"]
    assert paced["bound_overlap_tps"] == pytest.approx(
        1 / max(compute, paced["gb_per_token"] / 0.05))


def test_bench_overhead_and_simulate(models, tmp_path):
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    _run(["overhead", "--model", str(stream_dir), "--repeats", "20", "--tokens", "4",
          "--rounds", "1"], tmp_path / "o")
    o = json.loads((tmp_path / "o" / "overhead.json").read_text())
    synced = {"_start", "_sync", "_route", "ensure", "_launch"}
    for case in ("paged, all hits", "paged, pool 25%", "paged, pool 25%, io=python",
                 "paged, pool 25%, prefetch"):
        steps = o["decode"][case]["steps_us"]
        assert set(steps) == synced | {"_in_graph", "rest of the token"}
        # Decode calls run inside the graph on the native path; the prefill
        # (more ids than slots), the Python path and prefetch's path sync.
        if "python" in case or "prefetch" in case:
            assert steps["_in_graph"] == 0 and all(steps[k] > 0 for k in synced)
        else:  # only the prefill synced (in chunks, with no launch, at a small pool)
            assert steps["_in_graph"] > 0 and all(steps[k] > 0 for k in ("_start", "_sync"))
    assert o["decode"]["resident"]["steps_us"] is None  # resident models have no steps
    # What each round read counts its timed tokens only: every expert
    # resident reads nothing; a quarter of them misses.
    for case, reads in [("paged, all hits", 0), ("paged, pool 25%", 1)]:
        rounds = o["decode"][case]["runs_reads"]
        assert [r["tokens"] for r in rounds] == [4]
        assert all((r["misses"] > 0) == bool(reads) for r in rounds)

    _run(["simulate", "--validate", "--model", str(stream_dir), "--mlx-model", str(src),
          "--pools", "0.25,0.5", "--prefetch", "off,next-layer", "--max-tokens", "6"],
         tmp_path / "s")
    s = json.loads((tmp_path / "s" / "simulate.json").read_text())
    assert [r["pool"] for r in s["rows"]] == [0.25, 0.25, 0.5, 0.5]
    assert all(r["projected_tps"] > 0 and r["measured_tps"] > 0 for r in s["rows"])
    # Each case is projected with the costs of the path it ran: prefetch
    # syncs on the host every call, calls without it run in the graph.
    assert [r["path"] for r in s["rows"]] == ["calls in the graph", "a host sync per call"] * 2
    # Each case is forecast by predict's speed model at the hit rate it
    # measured, with this machine's measured costs.
    assert all(r["hit_rate"] is not None and r["misses_per_token"] >= 0 for r in s["rows"])
    assert s["machine"]["memory_gbps"] > 0 and s["machine"]["ssd_gbps"] > 0
    assert set(s["call_s"]) == {"calls in the graph", "a host sync per call"}
    trace = tmp_path / "s" / "decode" / "decode-trace.jsonl"
    _run(["simulate", "--project", "--trace", str(trace), "--policies", "lru,lfu-decay"],
         tmp_path / "p")
    p = json.loads((tmp_path / "p" / "projection.json").read_text())
    fitted = [r for r in p["rows"] if r.get("projected_tps")]
    assert {r["policy"] for r in fitted} == {"lru", "lfu-decay"}
    # More memory never projects a smaller pool for the same model.
    by = {(r["machine"], r["model"]): r["pool"] for r in p["rows"]}
    assert by[("MacBook Pro M4 Max 128 GB", "Qwen3-235B-A22B-4bit")] >= \
        by[("MacBook Pro M4 Pro 48 GB", "Qwen3-235B-A22B-4bit")]


def test_bench_fetch_compares_the_hub_with_local_disk(models, tmp_path):
    _, stream_dir = models.get("qwen3_moe", quantized=True)
    _run(["fetch", "--model", str(stream_dir), "--pool", "0.25", "--disk-cache", "0,1",
          "--max-tokens", "8", "--bandwidth-mbps", "50", "--latency-ms", "1"], tmp_path / "f")
    rows = json.loads((tmp_path / "f" / "fetch.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 4
    local, none, full, kept = rows
    assert "mb_fetched_per_token" not in local and local["vs_local"] == 1
    # Without a disk cache every pool miss is fetched; a filled cache fetches nothing.
    assert none["mb_fetched_per_token"] > 0 and none["disk_hit_rate"] is None
    assert kept["mb_fetched_per_token"] == 0 and kept["disk_hit_rate"] == 1
    assert full["requests_per_token"] <= none["requests_per_token"]


def test_bench_speculative_with_real_drafts(models, tmp_path):
    src, stream_dir = models.get("qwen3_moe", quantized=True)
    _run(["speculative", "--model", str(stream_dir), "--mlx-model", str(src), "--drafts",
          f"ngram,model:{src}", "--draft-tokens", "2", "--pools", "0.25", "--tokens", "8",
          "--repeats", "1", "--overlap", "on,off"], tmp_path / "v")
    rows = json.loads((tmp_path / "v" / "speculative-drafts.json").read_text())["rows"]
    streamed = [r for r in rows if r["case"].startswith("streamed")]
    assert {r["case"] for r in streamed} == {"streamed 4/16 overlap on",
                                             "streamed 4/16 overlap off"}
    resident = [r for r in rows if r["case"] == "mlx-lm resident"]
    assert {r["draft"] for r in streamed} == {"none", "ngram", f"model:{src}"}
    assert f"model:{src} (mlx-lm)" in {r["draft"] for r in resident}
    # Every speculative run gave greedy decoding's tokens; the target as its
    # own draft is accepted.
    assert all(r["exact"] in ("True", "-") for r in rows)
    own = [r for r in streamed if r["draft"] == f"model:{src}"]
    assert all(r["acceptance"] > 0.5 for r in own)


def test_paired_ratio_cancels_the_machines_drift():
    from mlx_streaming.bench.runs import paired_ratio

    # A case at 0.8x of its baseline in every round, the machine twice as
    # fast in the last rounds: the ratio of medians says 1.07x.
    baseline = [100, 100, 200, 200, 200]
    case = [80, 80, 160, 160, 160]
    assert paired_ratio(case, baseline) == pytest.approx(0.8)
    assert np.median(case) / np.median(baseline[:2]) > 1
    assert paired_ratio([None, 50], [100, 100]) == pytest.approx(0.5)
    assert paired_ratio([None], [100]) is None


@pytest.mark.parametrize("flag, value, said", [
    ("--prefetch", "off,next_layer", "'next_layer'"),
    ("--policies", "lru,lfu-decayed", "'lfu-decayed'"),
    ("--pools", "0.25,0", "'0.25,0'"),
    ("--pools", "1.5", "'1.5'"),
    ("--pools", "quarter", "'quarter'"),
    ("--prefetch-affinity", "on,of", "'of'"),
    ("--overlap", "yes", "'yes'"),
    ("--prefetch-depth", "1,3", "'1,3'"),
    ("--prefetch-depth", "1,2,", "'1,2,'"),
    ("--prefetch-precision", "0.5,", "'0.5,'"),
    ("--prefetch-precision", "0,1.5", "prefetch_precision must be")])
def test_decode_refuses_a_misspelt_choice_before_it_runs(tmp_path, capsys, flag, value, said):
    # No model at this path: the value is refused before it is looked for.
    assert bench_main(["decode", "--model", str(tmp_path / "none"), flag, value,
                       "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert flag in err and said in err


@pytest.mark.parametrize("command, flag, value", [
    ("decode", "--policies", ",,"),  # ran three cases of no policy
    ("decode", "--checksums", "x"),
    ("decode", "--io", "bogus"),
    ("decode", "--cache-gb", "1e30"),  # each streaming case failed, the run exited 0
    ("decode", "--temp", "1e-38"),
    ("io", "--temp", "0.0009"),
    ("fetch", "--bandwidth-mbps", "1e-38"),  # the stand-in's clock overflowed
    ("fetch", "--latency-ms", "1e30"),
])
def test_values_no_case_could_run_are_refused_up_front(tmp_path, capsys, command, flag, value):
    """Found by a hostile probe: each ran every case into an error."""
    assert bench_main([command, "--model", str(tmp_path / "none"), flag, value,
                       "--out", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert flag in err and repr(value) in err and "Traceback" not in err, err
    assert not (tmp_path / "d").exists()


def test_a_failed_case_says_why_as_it_ends(tmp_path, capsys):
    from mlx_streaming.bench.runs import run_case

    result = run_case(dict(op="decode", kind="streaming", model=str(tmp_path / "none"),
                           max_tokens=2, prompt_tokens=4, temp=0.0, load=dict(io="python")))
    assert result["status"] == "error"
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench: ")]
    assert line.startswith("bench: decode streaming io=python: error (") and "none" in line


def test_decode_takes_one_way_to_slow_the_disk(tmp_path, capsys):
    assert bench_main(["decode", "--model", str(tmp_path / "none"), "--pace-mbps", "100",
                       "--read-mbps", "100", "--out", str(tmp_path / "d")]) == 1
    assert "give one" in capsys.readouterr().err


def _trace(path, tokens=40, predicted=False, predicted2=False, probs=False):
    """A routing trace of two MoE layers of 8 experts, top-2, that routes to
    the first 6 only."""
    lines = []
    for t in range(tokens):
        for layer in (0, 1):
            r = {"layer": layer, "ids": [[t % 6, (t + 3) % 6]]}
            if predicted:
                r.update(predicted=[[t % 6, 7]], predicted_scores=[[4.0, 1.0]])
            if predicted2:
                r.update(predicted2=[[(t + 3) % 6]], predicted2_scores=[[4.0]])
            if probs:
                r["probs"] = [[1 / 8] * 8]
            lines.append(json.dumps(r) + "\n")
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("trace, flags, says", [
    (dict(predicted=True), ["--prefetch", "next-layer"], "does not model prefetch"),
    (dict(predicted=True), ["--prefetch", "off,next-layer", "--prefetch-depth", "2"],
     "does not model prefetch"),
    (dict(predicted=True), ["--prefetch", "next-layer", "--prefetch-precision", "2"],
     "--prefetch-precision: must be a finite number at least 0 and at most 1"),
    (dict(), ["--policies", "lru,bogus"], "--policies: must be values of policy"),
    (dict(tokens=3), [], "holds 3 decode tokens"),
    (dict(tokens=0), [], "holds 0 decode tokens"),
])
def test_simulate_project_refuses_what_it_cannot_project(tmp_path, capsys, trace, flags, says):
    path = _trace(tmp_path / "routing.jsonl", **trace)
    assert bench_main(["simulate", "--project", "--trace", str(path), *flags,
                       "--out", str(tmp_path / "p")]) == 1
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_simulate_project_adds_a_row_per_measured_setting(tmp_path, capsys):
    path = _trace(tmp_path / "routing.jsonl")
    quality = tmp_path / "quality.json"
    rows = [dict(setting="exact", status="ok", hit_rate=0.4, mb_per_token=0.2, ppl_change=0.0),
            dict(setting="cache-aware:2:8", status="ok", hit_rate=0.7, mb_per_token=0.1,
                 ppl_change=0.012),
            dict(setting="top-k-cut:1", status="error")]
    quality.write_text(json.dumps(dict(rows=rows)))
    _run(["simulate", "--project", "--trace", str(path), "--quality", str(quality)],
         tmp_path / "p")
    projected = json.loads((tmp_path / "p" / "projection.json").read_text())["rows"]
    streamed = [r for r in projected if r.get("setting") == "exact" and r["pool"] < 1]
    assert streamed
    for exact in streamed:
        ours = next(r for r in projected if r["machine"] == exact["machine"]
                    and r["model"] == exact["model"]
                    and r.get("setting", "").startswith("cache-aware:2:8 (+1.2% ppl)"))
        # Half the bytes per token: the reads' share of the token halves.
        share = exact["read_share"]
        assert ours["projected_tps"] == pytest.approx(exact["projected_tps"]
                                                       / (1 - share + share / 2))
        assert ours["hit_rate"] == pytest.approx(1 - (1 - exact["hit_rate"]) * 0.5)
    assert not any("top-k-cut" in r.get("setting", "") for r in projected)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench_main(["simulate", "--project", "--trace", str(path), "--quality", str(bad),
                       "--out", str(tmp_path / "p2")]) == 1
    assert "not a bench quality result" in capsys.readouterr().err


def test_simulate_project_refuses_a_cut_trace_and_takes_router_policies(tmp_path, capsys):
    path = _trace(tmp_path / "routing.jsonl", probs=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text(path.read_text()[:-20])  # an interrupted recording
    assert bench_main(["simulate", "--project", "--trace", str(cut),
                       "--out", str(tmp_path / "p")]) == 1
    assert "not a routing trace" in capsys.readouterr().err
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"layer": 0, "ids": 5}\n')
    assert bench_main(["simulate", "--project", "--trace", str(odd),
                       "--out", str(tmp_path / "p")]) == 1
    assert "not a routing trace" in capsys.readouterr().err
    # A policy that weighs the router's probabilities sizes itself from
    # them, not from the experts the trace happens to route to.
    assert bench_main(["simulate", "--project", "--trace", str(path), "--policies",
                       "router-ema", "--out", str(tmp_path / "p")]) == 0


def test_simulate_project_is_predicts_forecast_with_the_traces_hit_rates(tmp_path):
    """Each projected row is predict's speed model at the plan the loader
    makes of the machine's memory, with the trace replayed into a curve."""
    from mlx_streaming.bench.cache import decode_records
    from mlx_streaming.bench.case import WARMUP_TOKENS
    from mlx_streaming.bench.simulate.project import _shapes
    from mlx_streaming.predict.curves import replay_curve
    from mlx_streaming.predict.machines import MACHINES
    from mlx_streaming.predict.speed import forecast

    path = _trace(tmp_path / "routing.jsonl")
    _run(["simulate", "--project", "--trace", str(path), "--policies", "lru"], tmp_path / "p")
    rows = json.loads((tmp_path / "p" / "projection.json").read_text())["rows"]
    curve = replay_curve(decode_records(path), "lru", "t", warmup=WARMUP_TOKENS)
    shapes, macs = _shapes(), {m.name: m for m in MACHINES.values()}
    streamed = [r for r in rows if r.get("projected_tps") and r["pool"] < 1]
    assert streamed and {r["model"] for r in rows} == set(shapes)
    for r in streamed:
        f = forecast(shapes[r["model"]], macs[r["machine"]], r["slots_per_layer"], curve)
        assert r["projected_tps"] == pytest.approx(f.tok_s)
        assert r["hit_rate"] == pytest.approx(f.hit_rate)
    # A model larger than a machine's memory streams; one that fits is resident.
    pools = {(r["machine"], r["model"]): r["pool"] for r in rows}
    assert pools[("MacBook Pro M1 Pro 32 GB", "Qwen3-235B-A22B-4bit")] < 0.25
    assert pools[("Mac Studio M3 Ultra 256 GB", "Qwen3-30B-A3B-4bit")] == 1
    # Every model gets the largest budget its machine's loader plans.
    assert all(r.get("budget_gb") for r in rows if r.get("projected_tps"))


def test_simulate_says_which_trace_is_missing(tmp_path, capsys):
    missing = tmp_path / "nowhere.jsonl"
    assert bench_main(["simulate", "--project", "--trace", str(missing),
                       "--out", str(tmp_path / "p")]) == 1
    assert f"--trace: no such file: '{missing}'" in capsys.readouterr().err
    assert bench_main(["simulate", "--project", "--out", str(tmp_path / "p")]) == 1
    assert "--project needs --trace" in capsys.readouterr().err


def test_the_trace_marks_a_sigmoid_routers_layer(tmp_path):
    from mlx_streaming.runtime.trace import TraceWriter, read_trace_records

    # Layer 1 predicted two layers early only, layer 2 one layer early:
    # each record says which router its predictions came from.
    writer = TraceWriter(str(tmp_path / "t.jsonl"))
    ids = np.array([[1, 2]])
    writer.on_predict(1, np.array([[3, 4]]), np.array([[2.0, 1.0]]), distance=2, softmax=False)
    writer.on_predict(2, np.array([[3, 4]]), np.array([[2.0, 1.0]]), distance=1, softmax=True)
    for layer in (0, 1, 2):
        writer.on_route(layer, ids, np.unique(ids))
    writer.close()
    records = list(read_trace_records(str(tmp_path / "t.jsonl")))
    assert ["predicted2" in r for r in records] == [False, True, False]
    assert [r.get("sigmoid_router", False) for r in records] == [False, True, False]


@pytest.mark.parametrize("argv, message", [
    (["decode", "--max-tokens", "0"], "--max-tokens: must be an integer from 1"),
    (["decode", "--repeats", "0"], "--repeats: must be an integer from 1"),
    (["decode", "--temp", "-1"], "--temp: must be a finite number at least 0"),
    (["cache", "--tokens", "0"], "--tokens: must be an integer from 1"),
    (["cache", "--trace", "/no/such/trace"], "--trace: no such file"),
    (["speculative", "--max-k", "0"], "--max-k: must be an integer from 1 to 64"),
    (["speculative", "--drafts", "bogus"], "--drafts: must be ngram, mtp or model:PATH"),
    (["prefill", "--lengths", "abc"], "--lengths: must be an integer"),
    (["io", "--sizes", "4Q"], "--sizes: must be a size like 256K"),
    (["io", "--sizes", "5000"], "a multiple of 4096"),
    (["io", "--blob-gb", "-1"], "--blob-gb: must be a finite number above 0"),
    (["io", "--batch", "0"], "--batch: must be an integer from 1 to 1024"),
    (["io", "--batch", "100000"], "--batch: must be an integer from 1 to 1024"),
    (["io", "--threads", "100000"], "--threads: must be an integer from 1 to 64"),
    (["overhead", "--tokens", "0"], "--tokens: must be an integer from 1"),
    (["overhead", "--rounds", "0"], "--rounds: must be an integer from 1"),
    (["serve", "--clients", "0"], "--clients: must be an integer from 1 to 64"),
    (["serve", "--cases", "serial,fast"], "--cases: must be serial, batched or mlx-lm"),
    (["serve", "--cases", "mlx-lm+cache-aware"], "--cases: must be serial, batched or mlx-lm"),
    (["serve", "--cases", "batched+"], "--cases: must be serial, batched or mlx-lm"),
    (["serve", "--cases", "batched+cache-aware:9:8"], "--cases batched.* KEEP must be 1-"),
    (["serve", "--cases", "batched+exact"], "--cases: batched is exact already"),
    (["quality", "--tokens", "8", "--batch", "8"], "cannot make 8 streams"),
    (["quality", "--settings", "miss-bits:7"],
     "--settings miss-bits:7: BITS must be one of 2, 3, 4, 5, 6, 8"),
    (["quality", "--settings", "miss-bits:4"],
     "no 4-bit copies, and convert cannot write them .*already 4-bit"),
    (["quality", "--settings", ","], "--settings ',' holds an empty setting"),
    (["quality", "--settings", "skip-misses,,top-k-cut"], "holds an empty setting"),
    (["quality", "--text", "/dev/null"], "--text: '/dev/null' is not a regular file"),
    (["quality", "--text", "/"], "--text: '/' is a directory"),
    (["serve", "--requests", "0"], "--requests: must be an integer from 1"),
    (["fetch", "--bandwidth-mbps", "0"], "--bandwidth-mbps: must be a finite number at least 0.01"),
    (["fetch", "--bandwidth-mbps", "-5"], "--bandwidth-mbps: must be a finite number at least 0.01"),
    (["fetch", "--latency-ms", "-100"], "--latency-ms: must be a finite number at least 0"),
    (["decode", "--pace-mbps", "inf"], "--pace-mbps/--read-pace-mbps: must be a finite number"),
    # The bounds are the option's own (StreamConfig's), as generate's flag takes it.
    (["quality", "--read-pace-mbps", "0.001"], "must be a finite number at least 0.01"),
])
def test_bench_arguments_are_one_line_errors(qwen, argv, message, capsys):
    """Every bench argument is checked as it is parsed: a one-line error
    naming the flag, before anything runs (no traceback, no 32,000
    threads, no 24 GiB allocation)."""
    model = ["--model", str(qwen[1])] if argv[0] not in ("io", "cache") or "--trace" not in argv \
        else []
    rc = bench_main([argv[0], *model, *argv[1:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]


def test_bench_quality_refuses_an_empty_text(qwen, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    rc = bench_main(["quality", "--model", str(qwen[1]), "--text", str(tmp_path / "empty.txt"),
                     "--out", str(tmp_path / "q")])
    assert rc == 1 and "empty.txt' is empty" in capsys.readouterr().err


def test_a_bench_run_whose_every_case_fails_is_an_error(qwen, tmp_path, capsys):
    # A memory limit nothing fits in: every case fails.
    rc = bench_main(["prefill", "--model", str(qwen[1]), "--lengths", "8", "--memory-limit-gb",
                     "0.001", "--out", str(tmp_path)])
    assert rc == 1
    assert "every case failed" in capsys.readouterr().err


def test_simulator_measures_a_paged_call_without_its_reads():
    from mlx_streaming.bench.simulate.validate import _call_cost

    def reads(stall_seconds, tokens=4):
        return dict(stall_seconds=stall_seconds, tokens=tokens)

    # Resident at 100 tok/s. Per token the paged case adds 2.5 ms (80
    # tok/s), 10 ms (50) and 0.2 ms, of which it stalled on reads 1.5 ms
    # (6 ms over 4 tokens), 0 and 0: 1, 10 and 0.2 ms left for two layers'
    # calls, median 1 ms, so 0.5 ms a call.
    resident = dict(runs_tps=[100.0] * 3)
    case = dict(runs_tps=[80.0, 50.0, 1 / 0.0102],
                runs_reads=[reads(6e-3), reads(0.0), reads(0.0)])
    assert _call_cost(case, resident, layers=2) == pytest.approx(0.5e-3)
    # A stall longer than the whole overhead leaves nothing, not less.
    case["runs_reads"] = [reads(0.1)] * 3
    assert _call_cost(case, resident, layers=2) == 0


def test_the_validation_forecasts_each_case_at_its_measured_hit_rate():
    """--validate's machine gives the resident decode's measured time per
    token as compute, and its curve the case's measured hit rate."""
    from types import SimpleNamespace

    from mlx_streaming.bench.simulate.validate import _machine, _measured_hits
    from mlx_streaming.predict.speed import SpeedModel, forecast

    shape = SimpleNamespace(active_bytes=2e9, experts=64, top_k=8, moe_layers=4,
                            record_bytes=1e6)
    mac = _machine(shape, resident_tps=50.0, ssd_gbps=1.0)
    f = forecast(shape, mac, 16, _measured_hits(shape, 16, 0.75), SpeedModel(1.0, 1e-3),
                 paged=True)
    assert f.compute_s == pytest.approx(1 / 50) and f.hit_rate == pytest.approx(0.75)
    # 4 layers x 8 experts x a quarter missed, 1 MB each at 1 GB/s; 1 ms a call.
    assert f.misses_per_token == pytest.approx(8)
    assert 1 / f.tok_s == pytest.approx(0.02 + 4e-3 + 8e-3)
