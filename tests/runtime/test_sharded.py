"""Models split over ranks: two ranks on this box (``mlx.launch``, ring
backend), each streaming only its share, bit-identical to mlx-lm's own
``sharded_load`` of the same weights; the refusals and a lost rank."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_streaming
from mlx_streaming.bench.ranks import free_ports
from mlx_streaming.conversion.local import convert
from mlx_streaming.errors import ConfigError, ConversionError, FormatError
from mlx_streaming.format import read_manifest, record_checksum
from mlx_streaming.testing import rank_check, tiny
from mlx_streaming.testing.helpers import VOCAB, assert_same_logits, logits_trace, pool_sizes
from mlx_streaming.testing.hubserver import HubServer

LAUNCH = str(Path(sys.executable).parent / "mlx.launch")
TIMEOUT = 240


def launcher() -> list:
    """``mlx.launch`` of two local ring ranks on ports free a moment ago:
    its default ports are fixed, and two test workers launching at once
    would connect each other's ranks."""
    return [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(free_port_pair()),
            "--python", sys.executable]


def run_launched(cmd: list, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """Run an ``mlx.launch`` command; past ``timeout`` its ranks are killed
    with it (they would otherwise spin on, holding the cores)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def free_port_pair() -> int:
    """A port P on 127.0.0.1 with P and P + 1 free a moment ago."""
    while True:
        (port,) = free_ports(1)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
# Expert widths that split into two ranks' 4-bit groups of 64.
SPLITTABLE = dict(moe_intermediate_size=128)


@pytest.fixture(scope="module")
def split_models(models, tmp_path_factory):
    """``family -> (mlx-lm source, plain stream dir, 2-rank tensor-parallel dir)``."""
    root = tmp_path_factory.mktemp("split")
    cache = {}

    def get(family):
        if family not in cache:
            src, plain = models.get(family, True, **SPLITTABLE)
            tp = convert(src, root / f"{family}-tp2", tensor_parallel=2, progress=False)
            cache[family] = (src, plain, tp)
        return cache[family]

    return get


def launch(tmp_path, *args, timeout=TIMEOUT):
    """Run the rank check on two ranks; each rank's result, by rank."""
    out = tmp_path / "ranks"
    out.mkdir(exist_ok=True)
    proc = run_launched([*launcher(), rank_check.__file__, "--out", str(out), *map(str, args)],
                        timeout)
    results = []
    for r in range(2):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote nothing:\n{proc.stdout}\n{proc.stderr}"
        results.append(json.loads(f.read_text()))
    return results


def rank_bytes(stream_dir):
    """Bytes of each rank's slice of one expert (of the first layer)."""
    return [rank[0].expert_nbytes for rank in read_manifest(stream_dir).ranks]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "kimi_k3"])
def test_tensor_parallel_streaming_is_mlx_lms(split_models, family, tmp_path):
    src, plain, tp = split_models(family)
    pools = pool_sizes(tp)
    # One spine layer pinned, the others streamed through a ring of one buffer.
    results = launch(tmp_path, "--source", src, "--model", tp, "--mode", "tensor",
                     "--slots", ",".join(map(str, pools)),
                     "--options", json.dumps({"pinned_layers": 1, "spine_ring": 1}))
    whole = read_manifest(plain).layers[0].expert_nbytes
    whole_dense = [d.nbytes for d in read_manifest(plain).dense]
    for rank, (result, share) in enumerate(zip(results, rank_bytes(tp))):
        assert "error" not in result, result
        own = [d.nbytes for d in read_manifest(tp).dense_ranks[rank]]
        for slots in pools:
            pool = result["pools"][str(slots)]
            assert pool["same"], f"rank {rank}, {slots} slots: logits differ from mlx-lm's"
            total = pool["stats"]["total"]
            # One read per missed expert, of this rank's slice alone.
            assert total["bytes_read"] == total["records_read"] * share
            # Each pass reads every streamed spine layer: this rank's slice of its record.
            ring = pool["stats"]["spine"]
            passes, extra = divmod(ring["reads"], len(own) - 1)
            assert passes > 0 and extra == 0, ring
            assert any(round(ring["read_gb"] * 1e9) == passes * (sum(own) - pinned)
                       for pinned in own), (ring, own)
        assert share * 2 == whole and all(o < w for o, w in zip(own, whole_dense))
    # A pool of one call's experts reads; a pool of every expert does not.
    assert results[0]["pools"][str(pools[0])]["stats"]["total"]["records_read"] > 0
    assert results[0]["pools"][str(pools[-1])]["stats"]["total"]["records_read"] == 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "kimi_k3"])
def test_pipeline_streaming_is_mlx_lms(split_models, family, tmp_path):
    src, plain, _ = split_models(family)
    pools = pool_sizes(plain)
    results = launch(tmp_path, "--source", src, "--model", plain, "--mode", "pipeline",
                     "--slots", ",".join(map(str, pools)))
    moe_layers = len(read_manifest(plain).layers)
    stage_layers = []
    for rank, result in enumerate(results):
        assert "error" not in result, result
        assert result["pipeline_is_one_rank"]
        for slots in pools:
            assert result["pools"][str(slots)]["same"], f"rank {rank}, {slots} slots"
        stage_layers.append(len(result["pools"][str(pools[0])]["stats"]["layers"]))
    # Each rank streams its stage's layers only.
    assert sum(stage_layers) == moe_layers and min(stage_layers) >= 1


def test_a_pipeline_rank_fetches_only_its_stage_from_a_repo(split_models, tmp_path):
    from mlx_streaming.testing.hubserver import HubServer

    src, plain, _ = split_models("deepseek_v3")
    dense = [d.file for d in read_manifest(plain).dense]
    with HubServer({"org/split": plain}) as server:
        options = json.dumps({"endpoint": server.url,
                              "disk_cache_dir": str(tmp_path / "cache-{rank}")})
        results = launch(tmp_path, "--source", src, "--model", "org/split", "--mode",
                         "pipeline", "--slots", "4", "--options", options)
        fetched = [r.path for r in server.log if r.method == "GET" and "spine/" in r.path]
    for result in results:
        assert "error" not in result, result
        assert result["pools"]["4"]["same"]
    # Each dense record fetched once, by the rank whose stage holds it.
    assert sorted(p.rsplit("/", 1)[1] for p in fetched) == sorted(dense)


def test_ranks_loading_different_conversions_are_refused(split_models, tmp_path):
    _, _, tp = split_models("qwen3_moe")
    other = tmp_path / "other"
    shutil.copytree(tp, other)
    manifest = other / "experts" / "manifest.json"
    d = json.loads(manifest.read_text())
    d["layers"][0]["checksums"][0] ^= 1
    d["tensor_parallel"]["layers"][0][0]["checksums"][0] ^= 1
    manifest.write_text(json.dumps(d))
    results = launch(tmp_path, "--model", tp, "--model-rank1", other, "--mode", "tensor",
                     "--slots", "4")
    for result in results:
        assert "FormatError" in result["error"] and "rank 1's stream directory differs" in \
            result["error"], result


def test_each_ranks_dense_records_are_checked(split_models, tmp_path):
    _, _, tp = split_models("qwen3_moe")

    def altered(change):
        copy = tmp_path / f"tp{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tp, copy)
        manifest = copy / "experts" / "manifest.json"
        d = json.loads(manifest.read_text())
        change(d)
        manifest.write_text(json.dumps(d))
        return copy

    one = altered(lambda d: d["tensor_parallel"]["dense"].pop())
    with pytest.raises(FormatError, match="tensor_parallel.dense has 1 ranks, not 2"):
        read_manifest(one)
    shared = altered(lambda d: d["tensor_parallel"]["dense"][1][0].update(
        file=d["tensor_parallel"]["dense"][0][0]["file"]))
    with pytest.raises(FormatError, match="two ranks' dense records share a file"):
        read_manifest(shared)
    # A conversion from before the dense layers were split: each rank would
    # read the whole layers where shard() expects its slices.
    older = altered(lambda d: d["tensor_parallel"].pop("dense"))
    with pytest.raises(FormatError, match="earlier mlx_streaming .* convert it again, with --force"):
        mlx_streaming.sharded_load(older, tensor_group=mx.distributed.init())


def test_a_plain_conversion_on_one_tensor_rank_is_load(split_models):
    _, plain, _ = split_models("qwen3_moe")
    with mlx_streaming.sharded_load(plain, tensor_group=mx.distributed.init(), pinned_layers=1,
                                    spine_ring=1) as (model, _):
        split = logits_trace(model)
    with mlx_streaming.load(plain) as (model, _):
        assert_same_logits(logits_trace(model), split)


def test_ranks_loading_with_different_math_are_refused(split_models, tmp_path):
    _, _, tp = split_models("qwen3_moe")
    results = launch(tmp_path, "--model", tp, "--mode", "tensor", "--slots", "4",
                     "--options", json.dumps({"routing": "top-k-cut"}),
                     "--options-rank1", json.dumps({"routing": "exact"}))
    for result in results:
        assert "ConfigError" in result.get("error", "") and "routing" in result["error"] and \
            "rank 0 'top-k-cut'" in result["error"] and "rank 1 'exact'" in result["error"], \
            result


def test_ranks_may_differ_in_speed_and_memory(split_models, tmp_path):
    src, _, tp = split_models("qwen3_moe")
    results = launch(tmp_path, "--source", src, "--model", tp, "--mode", "tensor",
                     "--slots", "4", "--options-rank1",
                     json.dumps({"io": "python", "prefetch": "next-layer", "policy": "lru",
                                 "checksums": "always", "overlap": False,
                                 "io_threads": 2, "reserve_gb": 0.5}))
    for rank, result in enumerate(results):
        assert "error" not in result, result
        assert result["pools"]["4"]["same"], f"rank {rank}: logits differ from mlx-lm's"


def test_the_options_ranks_must_agree_on_change_the_math():
    from dataclasses import fields

    from mlx_streaming.config import StreamConfig

    agreed = {f.name for f in fields(StreamConfig) if f.metadata.get("same_on_ranks")}
    assert agreed == {"routing", "routing_keep", "routing_window", "routing_bonus",
                      "routing_max_ppl", "routing_check", "miss_bits", "miss_bits_weight"}


# Cache-aware routing at small pools, each rank's pool its own (size, policy,
# reader): the ranks route by what all of them hold, and check it.
ROUTE_ALIKE = dict(routing="cache-aware", routing_keep=1, routing_check=True)
RANK1_POOL = dict(slots_per_layer=6, policy="lru", io="python", overlap=False)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_tensor_parallel_ranks_route_alike_by_residency(split_models, family, tmp_path):
    _, _, tp = split_models(family)
    results = launch(tmp_path, "--model", tp, "--mode", "tensor", "--slots", "4",
                     "--options", json.dumps(ROUTE_ALIKE),
                     "--options-rank1", json.dumps(RANK1_POOL))
    for result in results:
        assert "error" not in result, result
        pool = result["pools"]["4"]
        assert any("approximate" in w for w in pool["warnings"]), pool["warnings"]
        # The tiny deepseek_v3 routes to few experts, all resident: nothing to substitute.
        if family == "qwen3_moe":
            assert pool["stats"]["routing"]["substituted"] > 0, pool["stats"]["routing"]
    # Both ranks hold the same summed outputs: the same logits to the bit.
    assert results[0]["pools"]["4"]["digest"] == results[1]["pools"]["4"]["digest"]
    # Each rank's own pool differs; the routing did not.
    routing = [r["pools"]["4"]["stats"]["routing"] for r in results]
    assert routing[0]["substituted"] == routing[1]["substituted"]


def test_a_rank_holding_every_expert_routes_with_the_others(split_models, tmp_path):
    _, _, tp = split_models("qwen3_moe")
    results = launch(tmp_path, "--model", tp, "--mode", "tensor", "--slots", "4",
                     "--options", json.dumps(ROUTE_ALIKE),
                     "--options-rank1", json.dumps({"slots_per_layer": 16}))
    for result in results:
        assert "error" not in result, result
        assert result["pools"]["4"]["stats"]["routing"]["substituted"] > 0
    assert results[0]["pools"]["4"]["digest"] == results[1]["pools"]["4"]["digest"]


def test_ranks_routing_apart_stop_every_rank(split_models, tmp_path):
    _, _, tp = split_models("qwen3_moe")
    results = launch(tmp_path, "--model", tp, "--mode", "tensor", "--slots", "4",
                     "--options", json.dumps(ROUTE_ALIKE), "--desync")
    for result in results:
        assert "RankError" in result.get("error", "") and \
            "rank(s) 1 routed a token of layer" in result["error"], result


def test_tensor_parallel_ranks_read_their_own_low_bit_copies(split_models, tmp_path):
    src, _, _ = split_models("qwen3_moe")
    tp = convert(src, tmp_path / "tp-q2", tensor_parallel=2, miss_bits=(2,), progress=False)
    manifest = read_manifest(tp)
    (copies,) = manifest.low_bits
    for rank, (layers, low) in enumerate(zip(manifest.ranks, copies.ranks)):
        assert [spec.file for spec in low] == [spec.file.replace(".blob", ".q2.blob") for spec in layers]
        assert all(f"rank{rank}of2" in spec.file for spec in low)
    assert mlx_streaming.format.damaged_records(tp) == []
    # Rank 1's pool is three times larger: the ranks take copies for the misses of either.
    results = launch(tmp_path, "--model", tp, "--mode", "tensor", "--slots", "4",
                     "--options", json.dumps({"miss_bits": 2}),
                     "--options-rank1", json.dumps({"slots_per_layer": 12}))
    pairs = []
    for result in results:
        assert "error" not in result, result
        pool = result["pools"]["4"]
        assert any("miss_bits=2" in w and "approximate" in w for w in pool["warnings"])
        pairs.append(pool["stats"]["total"]["low_bit_pairs"])
    assert pairs[0] == pairs[1] > 0
    assert results[0]["pools"]["4"]["digest"] == results[1]["pools"]["4"]["digest"]
    # A rank that holds every expert misses nothing, so it could not choose with the others.
    results = launch(tmp_path, "--model", tp, "--mode", "tensor", "--slots", "4",
                     "--options", json.dumps({"miss_bits": 2}),
                     "--options-rank1", json.dumps({"slots_per_layer": 16}))
    for result in results:
        assert "ConfigError" in result.get("error", "") and \
            "rank(s) 1 hold every expert" in result["error"], result


def test_a_rank_that_cannot_load_stops_every_rank(split_models, tmp_path):
    _, _, tp = split_models("qwen3_moe")
    results = launch(tmp_path, "--model", tp, "--model-rank1", tmp_path / "missing",
                     "--mode", "tensor", "--slots", "4")
    assert "FormatError" in results[1]["error"] and "does not exist" in results[1]["error"]
    assert "RankError" in results[0]["error"] and "rank(s) 1 could not load" in \
        results[0]["error"], results[0]


def test_a_budget_too_small_on_a_rank_says_what_fits(split_models, tmp_path):
    _, _, tp = split_models("qwen3_moe")
    results = launch(tmp_path, "--model", tp, "--mode", "tensor", "--slots", "0",
                     "--options", json.dumps({"cache_gb": 1e-5}))
    for result in results:
        assert "BudgetError" in result["error"] and "use --cache-gb" in result["error"]
        assert "safetensors" not in result["error"], result  # no advice to convert again


def test_split_flags_without_ranks_are_refused(split_models):
    _, _, tp = split_models("qwen3_moe")
    for module in ("mlx_streaming.generate", "mlx_streaming.server"):
        run = subprocess.run([sys.executable, "-m", module, "--model", str(tp),
                              "--tensor-parallel"], capture_output=True, text=True,
                             timeout=TIMEOUT)
        assert run.returncode == 1 and "this process runs alone" in run.stderr or \
            "this server runs alone" in run.stderr, run.stderr


def test_what_cannot_split_is_refused_clearly(split_models, models, tmp_path):
    _, _, tp = split_models("qwen3_moe")
    alone = mx.distributed.init()  # a group of one: the refusals come before any collective
    with pytest.raises(FormatError, match="converted for 2 tensor-parallel ranks.*sharded_load"):
        mlx_streaming.load(tp)
    with pytest.raises(FormatError, match="converted for 2 tensor-parallel rank.*1 run tensor"):
        mlx_streaming.sharded_load(tp, tensor_group=alone)
    with pytest.raises(FormatError, match="a conversion for 2 tensor-parallel ranks: run it "
                                          "tensor parallel"):
        mlx_streaming.sharded_load(tp, pipeline_group=alone)
    _, gpt_oss = models.get("gpt_oss", True)
    with pytest.raises(ConfigError, match="gpt_oss's mlx-lm model has no model.pipeline.*"
                                          "--tensor-parallel"):
        mlx_streaming.sharded_load(gpt_oss, pipeline_group=alone)
    with pytest.raises(ConfigError, match="either pipeline_group or tensor_group"):
        mlx_streaming.sharded_load(tp, pipeline_group=alone, tensor_group=alone)
    src, mixtral = models.get("mixtral", True)
    with pytest.raises(ConfigError, match="mixtral's mlx-lm model has no shard()"):
        mlx_streaming.sharded_load(mixtral, tensor_group=alone)
    with pytest.raises(ConversionError, match="mixtral's mlx-lm model has no shard()"):
        convert(src, tmp_path / "mixtral-tp", tensor_parallel=2, progress=False)
    narrow, _ = models.get("qwen3_moe", True)  # 64-wide experts: one 4-bit group
    with pytest.raises(ConversionError, match="cannot be split into 2 tensor-parallel ranks"):
        convert(narrow, tmp_path / "narrow-tp", tensor_parallel=2, progress=False)
    with pytest.raises(ConversionError, match="--tensor-parallel must be"):
        convert(narrow, tmp_path / "none", tensor_parallel=0, progress=False)


def test_check_reads_every_ranks_records(split_models, tmp_path):
    _, _, tp = split_models("qwen3_moe")
    copy = tmp_path / "tp"
    shutil.copytree(tp, copy)
    assert mlx_streaming.format.damaged_records(copy) == []
    spec = read_manifest(copy).ranks[1][0]
    with open(copy / "experts" / spec.file, "r+b") as f:
        f.seek(spec.record_offset(3) + spec.segments[0].offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert mlx_streaming.format.damaged_records(copy) == [(spec.layer, 3)]
    # A machine holding one rank's files checks them alone, its dense records too.
    manifest = read_manifest(copy)
    for f in [*(copy / "experts").glob("*.rank0of2.blob"), *(copy / "spine").glob("*.rank0of2.blob")]:
        f.unlink()
    assert mlx_streaming.format.damaged_spine(copy, manifest, rank=1) == []
    assert mlx_streaming.format.damaged_spine(copy, manifest) == [
        f"spine/{d.file}" for d in manifest.dense_ranks[0]]
    one = subprocess.run([sys.executable, "-m", "mlx_streaming.check", str(copy), "--rank", "1"],
                         capture_output=True, text=True)
    assert one.returncode == 1 and "1 damaged expert records: layer " in one.stderr, one.stderr
    dense = manifest.dense_ranks[1][-1]
    with open(copy / "spine" / dense.file, "r+b") as f:
        f.write(b"\xff" * 8)
    assert mlx_streaming.format.damaged_spine(copy, manifest, rank=1) == [f"spine/{dense.file}"]
    with pytest.raises(FormatError, match="expert blob .* is missing"):
        mlx_streaming.format.damaged_records(copy)
    with pytest.raises(FormatError, match="no tensor-parallel rank 2"):
        mlx_streaming.format.damaged_records(copy, rank=2)
    # The rank's checksums are of its own slice's bytes.
    with open(copy / "experts" / spec.file, "rb") as f:
        f.seek(spec.record_offset(0))
        record = f.read(spec.stride)
    assert record_checksum(record[s.offset:s.offset + s.nbytes] for s in spec.segments) == \
        spec.checksums[0]


def _generate(model, *flags):
    return [sys.executable, "-m", "mlx_streaming.generate", "--model", str(model),
            "--prompt", "def", "--ignore-chat-template", *flags]


def test_generate_runs_split_and_rank_0_speaks(split_models):
    _, plain, _ = split_models("deepseek_v3")
    one = subprocess.run(_generate(plain, "--max-tokens", "12"), capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert one.returncode == 0, one.stderr
    two = run_launched([*launcher(), *_generate(plain, "--max-tokens", "12", "--pipeline")[1:]])
    assert two.returncode == 0, two.stderr
    # A pipeline is mlx-lm on one rank: the same text, printed once.
    assert two.stdout == one.stdout
    assert "rank 0: hit rate" in two.stderr and "rank 1: hit rate" in two.stderr


def _ranks_by_hand(tmp_path, model, *flags):
    """Two ranks started without mlx.launch (which would stop the others
    itself): only our own handling of a lost rank is left. Each leads a
    process group of its own (with its watchdog)."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    procs = []
    for rank in range(2):
        env = dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK=str(rank))
        procs.append(subprocess.Popen(_generate(model, *flags), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True))
    return procs


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_rank_stops_the_others(split_models, tmp_path, how):
    _, _, tp = split_models("qwen3_moe")
    rank0, rank1 = _ranks_by_hand(tmp_path, tp, "--tensor-parallel", "--max-tokens", "1000000",
                                  "--rank-timeout", "5")
    try:
        assert rank0.stdout.read(1)  # rank 0 is generating
        rank1.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        _, err = rank0.communicate(timeout=60)  # within the timeout, or the test fails
        # A rank that hangs is killed by its watchdog (it may be blocked holding the GIL),
        # unless the backend gives the stopped peer up first: either way a clear error.
        lost = "error: rank 0 lost its peers" in err
        waited = "error: rank 0 waited 5 s for its peers" in err
        # A killed peer is usually reported by the ring backend at once, but
        # on a loaded machine a collective can hang on it: the watchdog's line.
        assert (lost and rank0.returncode == 1) or (waited and rank0.returncode == -signal.SIGKILL), \
            (rank0.returncode, err)
    finally:
        for p in (rank0, rank1):
            p.kill()
            p.communicate()


def test_a_stopped_rank_does_not_say_it_waited_for_its_peers(split_models, tmp_path):
    """Only ranks that waited say so: rank 1, stopped for longer than the
    timeout and then resumed, was not waiting (test_a_stopped_rank_is_not_
    one_that_waited covers its watchdog stopped with it)."""
    _, _, tp = split_models("qwen3_moe")
    rank0, rank1 = _ranks_by_hand(tmp_path, tp, "--tensor-parallel", "--max-tokens", "1000000",
                                  "--rank-timeout", "5")
    try:
        assert rank0.stdout.read(1)  # rank 0 is generating
        rank1.send_signal(signal.SIGSTOP)
        _, err0 = rank0.communicate(timeout=60)
        assert "error: rank 0 waited 5 s for its peers" in err0 or \
            "error: rank 0 lost its peers" in err0, err0
        time.sleep(6)  # rank 1 stopped for longer than its own timeout
        rank1.send_signal(signal.SIGCONT)
        _, err1 = rank1.communicate(timeout=60)
        # Resumed, it finds its peers gone: the backend says so, or (when a
        # collective hangs instead) its watchdog says it was stopped.
        assert "waited" not in err1 and ("error: rank 1 lost its peers" in err1 or
                                         "error: rank 1 was stopped for" in err1), err1
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


# A rank's stand-in, watched: beats (as MoE calls do), says "ready" once its
# watchdog has started, and goes on beating ("beats") or, once its own clock
# jumps (it was stopped), hangs ("hang"); "stuck" hangs once ready.
_FAKE_RANK = """
import sys, time
from mlx_streaming.sharded import Watchdog
dog = Watchdog(1, float(sys.argv[1]))
start = then = time.monotonic()
while True:
    now = time.monotonic()
    if sys.argv[2] == "hang" and now - then > 1.0:
        time.sleep(1000)
    dog.beat()
    then = now
    if now - start > 1.0:
        if not sys.stdout.closed:
            print("ready", flush=True)
            sys.stdout.close()
        if sys.argv[2] == "stuck":
            time.sleep(1000)
    time.sleep(0.05)
"""


def _fake_rank(then):
    rank = subprocess.Popen([sys.executable, "-c", _FAKE_RANK, "2", then], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    assert rank.stdout.readline() == "ready\n"
    return rank


def test_a_rank_that_makes_no_progress_says_it_waited():
    rank = _fake_rank("stuck")
    _, err = rank.communicate(timeout=30)
    assert rank.returncode == -signal.SIGKILL
    assert "error: rank 1 waited 2 s for its peers" in err, err


@pytest.mark.parametrize("then, whole", [("beats", False), ("hang", False), ("hang", True)],
                         ids=["resumed", "resumed-stuck", "resumed-stuck-with-its-watchdog"])
def test_a_stopped_rank_is_not_one_that_waited(then, whole):
    """Stopped (alone, or with its watchdog as Ctrl-Z stops both) for longer
    than the timeout: not killed as a rank that waited; resumed and stuck,
    it says it was stopped."""
    rank = _fake_rank(then)
    send = (lambda sig: os.killpg(rank.pid, sig)) if whole else rank.send_signal
    try:
        send(signal.SIGSTOP)
        time.sleep(4)
        send(signal.SIGCONT)
        if then == "beats":
            time.sleep(3)
            assert rank.poll() is None
            os.killpg(rank.pid, signal.SIGKILL)
        _, err = rank.communicate(timeout=30)
        assert "waited" not in err, err
        if then == "hang":
            assert rank.returncode == -signal.SIGKILL
            assert "error: rank 1 was stopped for 4 s (a signal, Ctrl-Z or a debugger) and " \
                   "has made no progress for 2 s since it resumed" in err, err
    finally:
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
            rank.communicate()


def test_the_server_serves_a_split_model(split_models):
    """Rank 0 answers; rank 1 decodes each request with it (mlx-lm's loop)."""
    import urllib.request

    _, _, tp = split_models("qwen3_moe")
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [*launcher(), "-m",
         "mlx_streaming.server", "--model", str(tp), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.3)
        body = json.dumps({"prompt": "def", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            text = json.loads(r.read())["choices"][0]["text"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.communicate(timeout=60)
    split = run_launched([*launcher(),
                          *_generate(tp, "--max-tokens", "8", "--tensor-parallel")[1:]])
    assert split.returncode == 0, split.stderr
    assert text and split.stdout.strip() == text.strip()


def test_bench_runs_the_ranks_with_the_same_settings(split_models, tmp_path):
    from mlx_streaming.bench.__main__ import main as bench_main

    _, plain, tp = split_models("qwen3_moe")
    text = tmp_path / "text.txt"
    text.write_text("def read(path):\n    with open(path) as f:\n        return f.read()\n" * 20)
    assert bench_main(["quality", "--model", str(plain), "--tp-model", str(tp), "--ranks", "2",
                       "--text", str(text), "--tokens", "24", "--settings", "cache-aware:1:8",
                       "--out", str(tmp_path / "q")]) == 0
    exact, aware = json.loads((tmp_path / "q" / "quality.json").read_text())["rows"]
    assert exact["status"] == aware["status"] == "ok", (exact, aware)
    assert exact["kl"] == 0 and aware["route_agreement"] < 1
    assert bench_main(["decode", "--model", str(plain), "--tp-model", str(tp), "--ranks", "2",
                       "--cache-gb", "0.002", "--max-tokens", "4", "--prompt-tokens", "8",
                       "--settings", "cache-aware:1:8", "--out", str(tmp_path / "d")]) == 0
    rows = json.loads((tmp_path / "d" / "decode-ranks.json").read_text())["rows"]
    assert rows[-1]["case"].endswith("cache-aware:1:8") and rows[-1]["status"] == "ok", rows


# A tensor-parallel repo from the local Hub stand-in, loaded by repo id.
RANK_BLOB = re.compile(r"experts/layer\d+\.rank(\d)of2\.blob$")


def _cached_blobs(cache: Path) -> set:
    """The expert blobs whose records a rank's disk cache holds."""
    return {p.name for p in (cache / "records").rglob("*.blob") if p.is_dir()}


def _source(models, family: str, mode: str, root: Path) -> Path:
    """A 4-bit mlx-lm model of ``family``, its weights in ``mode``."""
    if mode == "affine":
        return models.get(family, True, **SPLITTABLE)[0]
    config = tiny.tiny_config(family, VOCAB, **SPLITTABLE)
    return tiny.save_mlx_model(tiny.build_model(config), config, root / "src", models.tokenizer_dir,
                               quantize=True, group_size=32, bits=4, mode=mode)


@pytest.mark.parametrize("family, mode", [("qwen3_moe", "affine"), ("deepseek_v3", "affine"),
                                          ("kimi_k3", "mxfp4")])
def test_a_tensor_parallel_repo_is_mlx_lms_and_each_rank_fetches_its_slices(
        models, family, mode, tmp_path):
    src = _source(models, family, mode, tmp_path)
    tp = convert(src, tmp_path / "tp2", tensor_parallel=2, progress=False)
    with HubServer({"org/tp": tp}) as server:
        options = json.dumps({"endpoint": server.url,
                              "disk_cache_dir": str(tmp_path / "cache-{rank}")})
        results = launch(tmp_path, "--source", src, "--model", "org/tp", "--mode", "tensor",
                         "--slots", "4", "--options", options)
        gets = [r for r in server.log if r.method == "GET"]
    for rank, result in enumerate(results):
        assert "error" not in result, result
        assert result["pools"]["4"]["same"], f"rank {rank}: logits differ from mlx-lm's"
        blobs = _cached_blobs(tmp_path / f"cache-{rank}")
        assert blobs and all(RANK_BLOB.search(f"experts/{b}").group(1) == str(rank)
                             for b in blobs), (rank, sorted(blobs))
        dense = {p.name for p in (tmp_path / f"cache-{rank}").rglob("*.blob")
                 if p.parent.name == "spine"}
        assert dense == {d.file for d in read_manifest(tp).dense_ranks[rank]}, (rank, dense)
    # Every expert read was a range of one rank's blob; none of a whole blob.
    expert_gets = [r for r in gets if r.path.startswith("experts/layer")]
    assert expert_gets and all(RANK_BLOB.search(r.path) and r.range is not None
                               for r in expert_gets)
    manifest = read_manifest(tp)
    if mode != "affine":
        assert {spec.quantization["gate_proj"]["mode"] for spec in manifest.layers} == {mode}
    assert {r.path.rsplit("/", 1)[1] for r in expert_gets} <= {
        spec.file for layers in manifest.ranks for spec in layers}
