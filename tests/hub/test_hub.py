"""Models on the Hub: expert records fetched by HTTP range into a bounded
disk cache, plain mlx-lm repos converted shard by shard, uploads. A local
server started by each test stands in for the Hub (``hubserver``)."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.errors import ConfigError, FormatError
from mlx_streaming.format import read_manifest, record_checksum
from mlx_streaming.hub import repo as hub
from mlx_streaming.hub.disk_cache import DiskCache
from mlx_streaming.hub.ranges import ExpertFetchError
from mlx_streaming.runtime.stats import stats
from mlx_streaming.testing.helpers import assert_same_logits, greedy_text, logits_trace, reshard
from mlx_streaming.testing.hubserver import HubServer

REPO = "org/tiny-stream"


@pytest.fixture
def served(qwen):
    """A server holding the qwen stream directory as REPO."""
    with HubServer({REPO: qwen[1]}) as server:
        yield server


def local_reference(stream_dir, **kw):
    with mlx_streaming.load(stream_dir, slots_per_layer=4, **kw) as (model, tokenizer):
        return logits_trace(model), greedy_text(model, tokenizer)


def load_remote(server, cache_dir, **kw):
    kw.setdefault("slots_per_layer", 4)
    kw.setdefault("fetch_retries", 2)
    return mlx_streaming.load(REPO, endpoint=server.url, disk_cache_dir=str(cache_dir), **kw)


def assert_exact(server, cache_dir, reference, **kw):
    logits, text = reference
    with load_remote(server, cache_dir, **kw) as (model, tokenizer):
        assert_same_logits(logits, logits_trace(model))
        assert greedy_text(model, tokenizer) == text
        # The last token's last layer reads ahead for a next token's first
        # layer: counted once it has arrived.
        model.streaming.reader.drain()
        return stats(model)


def cached_records_are_good(cache_dir, stream_dir) -> int:
    """Every record file in the disk cache holds its expert's exact bytes."""
    manifest = read_manifest(stream_dir)
    specs = {s.file: s for s in manifest.layers}
    n = 0
    for f in (Path(cache_dir) / "records").rglob("*"):
        if not f.is_file() or f.name == ".lock":
            continue
        assert not f.name.endswith(".part"), f"unfinished record left: {f}"
        spec = specs[f.parent.name]
        data = np.frombuffer(f.read_bytes(), np.uint8)
        crc = record_checksum(data[s.offset:s.offset + s.nbytes] for s in spec.segments)
        assert crc == spec.checksums[int(f.name)], f"damaged record cached: {f}"
        n += 1
    return n


@pytest.mark.parametrize("prefetch", ["off", "next-layer"])
def test_fetched_generation_is_exact_with_a_small_disk_cache(qwen, served, tmp_path,
                                                             monkeypatch, prefetch):
    cap = int(0.4 * hub.records_nbytes(read_manifest(qwen[1])))
    sizes = []
    put = DiskCache.put

    def checked_put(self, key, data):
        put(self, key, data)
        sizes.append(self.used)  # bytes on disk and being written, kept under the lock

    monkeypatch.setattr(DiskCache, "put", checked_put)
    reference = local_reference(qwen[1])
    report = assert_exact(served, tmp_path, reference, disk_cache_gb=cap / 1e9,
                          prefetch=prefetch, prefetch_records=4)
    remote = report["remote"]
    assert report["io"] == "remote" and remote["disk_cache_cap"] == cap
    assert remote["disk_cache_evicted"] > 0 and max(sizes) <= cap
    assert DiskCache(tmp_path / "records", cap).disk_bytes() <= cap
    assert cached_records_are_good(tmp_path, qwen[1]) > 0
    stride = read_manifest(qwen[1]).layers[0].stride
    ranges = [r.range for r in served.ranged()]
    # Adjacent records of one call come in one request (the prefill needs many).
    assert any(end - start + 1 > stride for start, end in ranges)
    assert remote["bytes_fetched"] == sum(end - start + 1 for start, end in ranges)


def test_prefetch_measures_the_network_as_its_disk(qwen, served, tmp_path):
    """A Hub repo's records come from the network or the disk cache: the
    reader meters those reads as a local one meters its disk, so that the
    prefetch budget is measured, not left at zero."""
    with load_remote(served, tmp_path, prefetch="next-layer",
                     disk_cache_gb=0) as (model, tokenizer):
        greedy_text(model, tokenizer)
        nbytes, busy = model.streaming.reader.busy()
        read = stats(model)["total"]["bytes_read"]
        assert read > 0 and nbytes >= read and busy > 0
        assert model.streaming.prefetch.bandwidth.rate is not None


def test_a_second_run_reads_from_the_disk_cache(qwen, served, tmp_path):
    reference = local_reference(qwen[1])
    first = assert_exact(served, tmp_path, reference)["remote"]
    second = assert_exact(served, tmp_path, reference)["remote"]
    assert first["bytes_fetched"] > 0 and second["bytes_fetched"] == 0
    assert second["disk_cache_hits"] > 0
    # A lower cap next time evicts down to it at open.
    third = assert_exact(served, tmp_path, reference, disk_cache_gb=100e3 / 1e9)["remote"]
    assert third["disk_cache_bytes"] <= 100e3 and third["bytes_fetched"] > 0


def is_record(request) -> bool:
    """An expert record fetch (dense records come whole with the spine)."""
    return request.path.startswith("experts/") and request.path.endswith(".blob")


def once(action):
    """A fault hook that answers the first record GET with ``action``."""
    fired = []

    def hook(request):
        if request.method == "GET" and is_record(request) and not fired:
            fired.append(request)
            return action
        return None

    hook.fired = fired
    return hook


@pytest.mark.parametrize("fault", ["drop", 503, "corrupt"])
def test_a_fault_once_is_retried_and_the_output_stays_exact(qwen, served, tmp_path, fault):
    reference = local_reference(qwen[1])
    hook = once(fault)
    served.faults.append(hook)
    report = assert_exact(served, tmp_path, reference, disk_cache_gb=1.0)
    assert hook.fired
    first = hook.fired[0]
    # The failed range was asked for again.
    assert [r.range for r in served.ranged()].count(first.range) >= 2 or fault == "corrupt"
    if fault == "corrupt":
        assert report["remote"]["corrupt_refetches"] == 1
    cached_records_are_good(tmp_path, qwen[1])


def test_a_server_ignoring_range_still_gives_exact_output(qwen, served, tmp_path, caplog):
    reference = local_reference(qwen[1])
    served.faults.append(lambda r: "full" if is_record(r) else None)
    with caplog.at_level(logging.WARNING, logger="mlx_streaming.hub.remote"):
        assert_exact(served, tmp_path, reference, disk_cache_gb=0)
    assert any("ignores HTTP Range" in r.message for r in caplog.records)


def test_bytes_wrong_twice_are_an_error_and_never_cached(qwen, served, tmp_path):
    served.faults.append(lambda r: "corrupt" if is_record(r) else None)
    with load_remote(served, tmp_path, disk_cache_gb=1.0) as (model, tokenizer):
        with pytest.raises(ExpertFetchError, match="fail the manifest's checksum twice"):
            greedy_text(model, tokenizer)
    # Records of the same answers that were right may be cached; none wrong is.
    cached_records_are_good(tmp_path, qwen[1])


def test_a_server_that_stops_answering_is_a_clear_error(served, tmp_path):
    served.faults.append(lambda r: "hang" if is_record(r) else None)
    model, tokenizer = load_remote(served, tmp_path, fetch_timeout=0.5, fetch_retries=1)
    start = time.perf_counter()
    with pytest.raises(ExpertFetchError, match="no answer within 0.5 s"):
        greedy_text(model, tokenizer)
    assert time.perf_counter() - start < 20


# The endpoint comes from huggingface_hub's own setting (HF_ENDPOINT) here.
KILL_SCRIPT = """
import sys, mlx_streaming
from mlx_streaming.testing.helpers import greedy_text
model, tok = mlx_streaming.load(sys.argv[1], disk_cache_dir=sys.argv[2],
                                slots_per_layer=4, disk_cache_gb=1.0)
greedy_text(model, tok)
"""


def test_sigkill_mid_fetch_leaves_a_consistent_cache(qwen, tmp_path):
    stride = read_manifest(qwen[1]).layers[0].stride
    with HubServer({REPO: qwen[1]}, bandwidth=stride / 0.3) as server:
        env = dict(os.environ, HF_ENDPOINT=server.url)
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, REPO, str(tmp_path)],
                                env=env)
        records = tmp_path / "records"
        deadline = time.time() + 120
        try:
            while time.time() < deadline and proc.poll() is None:
                done = [f for f in records.rglob("*") if f.is_file() and f.name != ".lock"] \
                    if records.exists() else []
                if len(done) >= 3:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, "the run ended before it could be killed"
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
        # Leftovers a kill can leave, planted for sure: a half-written record
        # file and a record damaged on disk.
        layer_dir = next(p for p in records.rglob("layer*.blob") if p.is_dir())
        (layer_dir / "000000.123.456.part").write_bytes(b"x" * 100)
        victim = next(f for f in layer_dir.iterdir() if not f.name.endswith(".part"))
        victim.write_bytes(b"\0" * stride)
        reference = local_reference(qwen[1])
        report = assert_exact(server, tmp_path, reference, disk_cache_gb=1.0)
        assert report["remote"]["disk_cache_hits"] > 0
    cached_records_are_good(tmp_path, qwen[1])


def test_plain_mlx_lm_repo_is_converted_shard_by_shard(qwen, tmp_path):
    from mlx_streaming.conversion.shards import convert_repo

    src = reshard(qwen[0], tmp_path / "sharded", max_bytes=300_000)
    shards = sorted(src.glob("model-*.safetensors"))
    largest = max(f.stat().st_size for f in shards)
    assert len(shards) >= 4
    work = tmp_path / "converted"
    peak = []

    def disk_use(root):
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())

    with HubServer({"org/plain": src}) as server:
        repo = hub.resolve("org/plain", None, server.url)
        out = convert_repo(repo, work,
                           on_shard=lambda name: peak.append(disk_use(work.with_name(
                               work.name + ".partial"))))
        final = disk_use(out)
        # The extra disk is about one shard, never the whole download.
        assert max(peak) - final <= 2 * largest
        assert sum(f.stat().st_size for f in shards) > 2 * largest
        assert not (out / ".download").exists() and not (out / ".pending").exists()
        for spec in read_manifest(out).layers:
            assert (out / "experts" / spec.file).read_bytes() == \
                (qwen[1] / "experts" / spec.file).read_bytes()
        # load() of the repo id converts into disk_cache_dir and runs it.
        reference = local_reference(qwen[1])
        with mlx_streaming.load("org/plain", endpoint=server.url,
                                disk_cache_dir=str(tmp_path / "c"),
                                slots_per_layer=4) as (model, tokenizer):
            assert_same_logits(reference[0], logits_trace(model))
            assert stats(model)["io"] != "remote"


def test_a_repo_without_an_index_loads_as_mlx_lm_loads_its_directory(tokenizer_dir, tmp_path):
    """model.safetensors plus more shards and no index (as
    scripts/make_synthetic_moe.py --format mlx-lm writes): mlx_lm.load
    reads every model*.safetensors of the directory, and so does a load of
    the repo id."""
    import mlx_lm

    from mlx_streaming.testing.synthetic import make_synthetic

    src = make_synthetic(tmp_path / "src", tokenizer_dir, fmt="mlx-lm")
    assert not (src / "model.safetensors.index.json").exists()
    assert len(list(src.glob("model*.safetensors"))) > 1
    reference, _ = mlx_lm.load(str(src))
    with HubServer({"org/no-index": src}) as server:
        with mlx_streaming.load("org/no-index", endpoint=server.url,
                                disk_cache_dir=str(tmp_path / "c"),
                                slots_per_layer=4) as (model, _):
            assert_same_logits(logits_trace(reference), logits_trace(model))


def test_convert_upload_publishes_a_streamable_repo(qwen, tmp_path):
    from mlx_streaming.conversion import command

    with HubServer(upload_root=tmp_path / "hub") as server:
        rc = command.main(["--model", str(qwen[0]), "--out", str(tmp_path / "s"),
                             "--no-progress", "--upload", "org/uploaded",
                             "--endpoint", server.url])
        assert rc == 0
        reference = local_reference(qwen[1])
        with mlx_streaming.load("org/uploaded", endpoint=server.url,
                                disk_cache_dir=str(tmp_path / "c"),
                                slots_per_layer=4) as (model, tokenizer):
            assert_same_logits(reference[0], logits_trace(model))
            assert stats(model)["io"] == "remote"


def test_generate_cli_runs_a_repo_id(served, tmp_path, capsys):
    from mlx_streaming import generate

    rc = generate.main(["--model", REPO, "--endpoint", served.url, "--disk-cache-dir",
                        str(tmp_path), "--max-tokens", "4", "--slots-per-layer", "4",
                        "--revision", "main"])
    assert rc == 0 and "HTTP range requests" in capsys.readouterr().err


def test_unknown_repo_revision_and_misuse_are_clear_errors(served, tmp_path, qwen):
    with pytest.raises(FormatError, match="neither a local directory nor a model repo"):
        mlx_streaming.load("org/missing", endpoint=served.url, disk_cache_dir=str(tmp_path))
    with pytest.raises(FormatError, match="no revision"):
        mlx_streaming.load(REPO, revision="v9", endpoint=served.url,
                           disk_cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="revision applies to Hugging Face repo ids"):
        mlx_streaming.load(qwen[1], revision="main")
    with pytest.raises(ConfigError, match="fetch_threads"):
        mlx_streaming.StreamConfig(fetch_threads=0)
    with pytest.raises(ConfigError, match="read_pace_mbps emulates a slower local disk"):
        load_remote(served, tmp_path, read_pace_mbps=100.0)
    assert not list(tmp_path.rglob("*.safetensors"))  # refused before the spine's download


def test_the_disk_cache_is_one_process_at_a_time(tmp_path):
    first = DiskCache(tmp_path, 1000)
    # flock locks are per open file: a second open conflicts as another process would.
    with pytest.raises(ExpertFetchError, match="another process uses the disk cache"):
        DiskCache(tmp_path, 1000)
    first.close()
    DiskCache(tmp_path, 1000).close()


def test_without_the_hub_a_filled_cache_still_runs(qwen, tmp_path):
    reference = local_reference(qwen[1])
    with HubServer({REPO: qwen[1]}) as server:
        url = server.url
        assert_exact(server, tmp_path, reference, slots_per_layer=32)  # every expert cached
    # The server is gone: load() says so and runs from the disk cache.
    with pytest.warns(RuntimeWarning, match="cannot reach the Hub"):
        model, tokenizer = mlx_streaming.load(REPO, endpoint=url, disk_cache_dir=str(tmp_path),
                                              slots_per_layer=4, fetch_retries=0)
    assert_same_logits(reference[0], logits_trace(model))
    assert stats(model)["remote"]["bytes_fetched"] == 0


def test_concurrent_puts_never_pass_the_cap_or_count_twice(tmp_path):
    cache = DiskCache(tmp_path, 150)
    record = np.zeros(100, np.uint8)
    barrier = threading.Barrier(4)

    def put(key):
        barrier.wait()
        cache.put(key, record)

    threads = [threading.Thread(target=put, args=(k,)) for k in ("a", "b", "c", "a")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cache.used <= 150 and cache.disk_bytes() == cache.used
    cache.close()


def test_retry_after_is_honoured_and_named(served):
    from mlx_streaming.hub.ranges import RangeFetcher

    fetcher = RangeFetcher({}, timeout=5, retries=2, backoff=0.01)
    waits = []

    class Recorder:  # stands in for the cancel event: records each wait
        def wait(self, seconds):
            waits.append(seconds)
            return False

        def is_set(self):
            return False

    fetcher.cancelled = Recorder()
    url = f"{served.url}/{REPO}/resolve/main/experts/layer001.blob"
    seen = []

    def limited(request):
        if is_record(request) and len(seen) < 2:
            seen.append(request)
            return (429, {"Retry-After": "3"})
        return None

    served.faults.append(limited)
    assert len(fetcher.fetch(url, 0, 100)) == 100
    assert waits == [3.0, 3.0]  # the server's Retry-After, not the 0.01 s backoff
    served.faults[:] = [lambda r: (429, {}) if is_record(r) else None]
    with pytest.raises(ExpertFetchError, match="rate limited"):
        fetcher.fetch(url, 0, 100)


def test_records_damaged_in_the_cache_mid_run_are_fetched_again(qwen, served, tmp_path):
    model, _ = load_remote(served, tmp_path, disk_cache_gb=1.0)
    reader = model.streaming.reader
    first = reader.records(0, [3])[0].copy()
    fetched = reader.fetcher.requests
    cached = next((tmp_path / "records").rglob("000003"))
    cached.write_bytes(b"\0" * cached.stat().st_size)
    again = reader.records(0, [3])[0]
    assert np.array_equal(again, first) and reader.fetcher.requests == fetched + 1


def test_close_does_not_wait_for_hung_fetches(served, tmp_path):
    served.faults.append(lambda r: "hang" if is_record(r) else None)
    model, _ = load_remote(served, tmp_path, fetch_timeout=20, fetch_retries=3)
    reader = model.streaming.reader
    staging = reader.staging(8, read_manifest_stride(model))
    ids = np.arange(4, dtype=np.int64)
    staging.stage(0, 0, ids, ids * read_manifest_stride(model))
    time.sleep(0.2)  # the first prefetch is in flight, the rest queued
    start = time.perf_counter()
    served.state.hang.set()  # the server lets go once we give up
    model.streaming.close()
    assert time.perf_counter() - start < 10  # 4 x (20 s x 4 tries) if it waited


def read_manifest_stride(model):
    return model.streaming.manifest.layers[0].stride


def test_two_models_share_one_disk_cache_dir(qwen, served, tmp_path):
    reference = local_reference(qwen[1])
    a, tok_a = load_remote(served, tmp_path)
    b, tok_b = load_remote(served, tmp_path)
    assert greedy_text(a, tok_a) == greedy_text(b, tok_b) == reference[1]
    a.streaming.close()
    assert greedy_text(b, tok_b) == reference[1]


def test_offline_revisions(qwen, tmp_path):
    reference = local_reference(qwen[1])
    with HubServer({REPO: qwen[1]}) as server:
        url = server.url
        commit = hub.resolve(REPO, None, url).commit
        assert_exact(server, tmp_path, reference, slots_per_layer=32)
    for revision in ("main", commit, commit[:8]):
        with (pytest.warns(RuntimeWarning, match=commit),
              mlx_streaming.load(REPO, revision=revision, endpoint=url,
                                 disk_cache_dir=str(tmp_path), slots_per_layer=4)):
            pass  # the load's warning is the check
    with pytest.raises(FormatError, match="cannot reach the Hub"):
        mlx_streaming.load(REPO, revision="0" * 40, endpoint=url, disk_cache_dir=str(tmp_path))


def test_conversions_of_one_repo_run_one_at_a_time(qwen, tmp_path):
    from mlx_streaming.conversion.shards import convert_repo

    src = reshard(qwen[0], tmp_path / "sharded", max_bytes=300_000)
    out, errors = [], []
    with HubServer({"org/plain": src}) as server:
        repo = hub.resolve("org/plain", None, server.url)

        def run():
            try:
                out.append(convert_repo(repo, tmp_path / "c"))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors and out == [tmp_path / "c"] * 2
    assert read_manifest(tmp_path / "c").layers


def test_a_server_on_a_hub_repo_logs_a_line_per_request(served, tmp_path):
    """Not one per range request (huggingface_hub's and httpx's INFO lines:
    808 for 32 tokens), nor mlx-lm's progress lines: start-up, then one
    line per request, at the default --log-level INFO."""
    from mlx_streaming.testing.helpers import Server

    s = Server(REPO, "--endpoint", served.url, "--disk-cache-dir", str(tmp_path / "c"),
               "--slots-per-layer", "4", "--disk-cache-gb", "0")
    try:
        for _ in range(2):
            assert s.post("/v1/completions", {"prompt": "def f(x):", "max_tokens": 16})[0] == 200
        # The line follows the answer: a loaded machine stopped the server between them.
        deadline = time.monotonic() + 30
        while "".join(s.lines).count("POST /v1/completions 200") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        err = s.stop()
    requests = [line for line in err.splitlines() if "POST /v1/completions 200" in line]
    assert len(requests) == 2, err
    assert len(served.ranged()) > 10  # the experts did come by range request
    assert not any(w in err for w in ("HTTP Request", "Prompt processing")), err
    assert len(err.splitlines()) <= 12, err  # start-up (a download's progress) and the two


def test_the_hub_stand_in_takes_clients_that_leave_early(qwen, capfd):
    """A client that resets its connection mid-request or mid-answer is no
    error of the server's: no traceback (11 in this sequence, before)."""
    import socket
    import struct

    with HubServer({REPO: qwen[1]}) as server:
        host, port = server._httpd.server_address[:2]
        blob = sorted((Path(qwen[1]) / "experts").glob("*.blob"))[0].name
        for path in (f"/api/models/{REPO}/revision/main", f"/{REPO}/resolve/main/config.json",
                     f"/api/models/{REPO}/tree/main", f"/{REPO}/resolve/main/experts/{blob}"):
            for cut in (10, None):
                s = socket.create_connection((host, port))
                request = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
                s.sendall(request[:cut])
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
        time.sleep(0.5)
    assert "Traceback" not in capfd.readouterr().err


def test_a_disk_cache_that_cannot_write_warns_once(tmp_path, caplog):
    """A full disk said so for every record (186 lines)."""
    cache = DiskCache(tmp_path / "c", 1 << 30)
    (tmp_path / "c" / "layer000.blob").write_text("a file where a directory goes")
    with caplog.at_level(logging.DEBUG, logger="mlx_streaming.hub.disk_cache"):
        for e in range(5):
            cache.put(f"layer000.blob/{e}", b"x" * 100)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "cannot write" in warned[0].getMessage()
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 5
    cache.close()


def test_an_empty_disk_cache_dir_is_refused(qwen):
    """"" was the current directory: hub/ and records/ written there."""
    with pytest.raises(ConfigError, match="disk_cache_dir must be a non-empty path"):
        mlx_streaming.load(REPO, disk_cache_dir="")


def test_a_local_directory_spelled_as_a_repo_id_says_so(qwen, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(qwen[1], tmp_path / "org" / "model")
    with (pytest.warns(UserWarning, match="local directory org/model, not the Hugging Face"),
          mlx_streaming.load("org/model", slots_per_layer=4)):
        pass  # the load's warning is the check
    with pytest.raises(ConfigError, match="revision must be a branch, tag or commit"):
        mlx_streaming.load(REPO, revision=5)


def test_an_upload_to_a_bad_repo_id_is_refused_before_converting(qwen, tmp_path):
    from mlx_streaming.conversion import command

    out = tmp_path / "s"
    rc = command.main(["--model", str(qwen[0]), "--out", str(out), "--no-progress",
                   "--upload", "bad id"])
    assert rc == 1 and not out.exists()
