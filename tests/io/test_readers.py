"""The readers: the Python and native ones read the same bytes, split large
records over threads, pace reads as a slower disk would, stage reads ahead,
and say which file and offset failed."""

import threading
import time
import zlib

import mlx.core as mx
import numpy as np
import pytest

import mlx_streaming
from mlx_streaming.errors import ExpertReadError
from mlx_streaming.io.native import NativeReader
from mlx_streaming.io.python import PythonReader, direct_io_works
from mlx_streaming.testing.helpers import EXT, WHY, check_matches_resident

STRIDE = 16384


def readers(direct=False):
    out = [PythonReader(2, direct)]
    if EXT is not None:
        out.append(NativeReader(EXT, 2, direct))
    return out


@pytest.fixture
def blob(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 8 * STRIDE, dtype=np.uint8)
    path = tmp_path / "layer000.blob"
    path.write_bytes(data.tobytes())
    return path, data


def test_extension_is_built_against_the_installed_mlx():
    assert EXT is not None, f"native extension {WHY}: `pip install -e .` builds it"
    assert EXT.mlx_version == mx.__version__.split(".dev")[0]
    assert EXT.crc32(b"mlx streaming") == zlib.crc32(b"mlx streaming")


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_readers_read_the_same_bytes(blob, direct):
    path, data = blob
    if direct and not direct_io_works(path):
        pytest.skip("this filesystem refuses O_DIRECT")
    segments = np.array([[0, 1000], [1024, 5000], [8192, 3000]], dtype=np.int64)
    experts = np.array([6, 1, 3], dtype=np.int64)
    results = []
    for reader in readers(direct):
        f = reader.open(str(path))
        dst = [np.zeros((3, n), np.uint8) for n in segments[:, 1]]
        addr = np.stack([d.ctypes.data + np.arange(3) * d.shape[1] for d in dst], 1).astype(np.int64)
        crcs = reader.read(f, experts * STRIDE, segments, addr, np.array([True, False, True]), STRIDE)
        results.append(([d.copy() for d in dst], crcs))
        reader.close()
        for i, e in enumerate(experts):
            for (off, n), d in zip(segments, dst):
                assert d[i].tobytes() == data[e * STRIDE + off : e * STRIDE + off + n].tobytes()
        want = zlib.crc32(b"".join(
            data[6 * STRIDE + o : 6 * STRIDE + o + n].tobytes() for o, n in segments))
        assert crcs[0] == want and crcs[1] == 0
    for other in results[1:]:
        assert all((a == b).all() for a, b in zip(results[0][0], other[0]))
        assert (results[0][1] == other[1]).all()


def test_large_records_are_split_across_threads(tmp_path):
    """A record larger than the native chunk (1 MiB) read by several threads."""
    stride = 3 << 20
    data = np.random.default_rng(1).integers(0, 256, 2 * stride, dtype=np.uint8)
    path = tmp_path / "big.blob"
    path.write_bytes(data.tobytes())
    segments = np.array([[0, stride - 4096]], dtype=np.int64)
    for reader in readers():
        f = reader.open(str(path))
        dst = np.zeros((2, stride - 4096), np.uint8)
        addr = (dst.ctypes.data + np.arange(2) * dst.shape[1]).reshape(2, 1).astype(np.int64)
        crcs = reader.read(f, np.array([stride, 0], np.int64), segments, addr,
                           np.array([True, True]), stride)
        assert (dst[0] == data[stride : 2 * stride - 4096]).all()
        assert (dst[1] == data[: stride - 4096]).all()
        assert crcs[1] == zlib.crc32(data[: stride - 4096].tobytes())
        reader.close()


def _paced_readers(mbps):
    out = [PythonReader(2, False, pace_mbps=mbps)]
    if EXT is not None:
        out.append(NativeReader(EXT, 2, False, pace_mbps=mbps))
    return out


def test_a_paced_reader_reads_no_faster_than_its_disk(blob):
    # read_pace_mbps emulates a slower disk: the same bytes, each read ending
    # no earlier than at that rate, reads one after another, with no credit
    # for idle time.
    path, data = blob
    mbps = 0.5  # 4 records of 16 KiB: 0.13 s at 0.5 MB/s
    segments = np.array([[0, STRIDE]], np.int64)
    for reader in _paced_readers(mbps):
        f = reader.open(str(path))
        dst = np.zeros((4, STRIDE), np.uint8)
        addr = (dst.ctypes.data + np.arange(4) * STRIDE)[:, None].astype(np.int64)
        start = time.perf_counter()
        reader.read(f, np.arange(4, dtype=np.int64) * STRIDE, segments, addr,
                    np.zeros(4, bool), STRIDE)
        assert time.perf_counter() - start >= 4 * STRIDE / (mbps * 1e6), reader.name
        time.sleep(0.2)  # idle: no credit for it
        start = time.perf_counter()
        reader.read(f, np.array([6 * STRIDE], np.int64), segments, addr[:1],
                    np.zeros(1, bool), STRIDE)
        assert time.perf_counter() - start >= STRIDE / (mbps * 1e6), reader.name
        reader.close()
        assert dst[1:].tobytes() == data[STRIDE : 4 * STRIDE].tobytes(), reader.name
        assert dst[0].tobytes() == data[6 * STRIDE : 7 * STRIDE].tobytes(), reader.name


@pytest.mark.parametrize("prefetch", ["off", "next-layer"])
@pytest.mark.parametrize("io", ["python", "native"])
def test_paced_reads_keep_outputs_exact(qwen, io, prefetch):
    if io == "native" and EXT is None:
        pytest.skip(f"native extension {WHY}")
    src, stream_dir = qwen
    model = check_matches_resident(src, stream_dir, slots_per_layer=4, io=io, prefetch=prefetch,
                                   read_pace_mbps=200.0)
    assert model.streaming.reader.name == io and model.streaming.reader.pace_mbps == 200.0


def test_short_read_names_file_and_offset(blob):
    path, _ = blob
    for reader in readers():
        f = reader.open(str(path))
        dst = np.zeros(100, np.uint8)
        with pytest.raises(ExpertReadError, match=f"short read of {path} at offset {8 * STRIDE}"):
            reader.read(f, np.array([8 * STRIDE], np.int64), np.array([[0, 100]], np.int64),
                        np.array([[dst.ctypes.data]], np.int64), np.array([False]), STRIDE)
        reader.close()


def test_missing_blob_is_a_clear_error(tmp_path):
    for reader in readers():
        with pytest.raises(ExpertReadError, match="cannot open .*missing.blob"):
            reader.open(str(tmp_path / "missing.blob"))


def test_staging_take_and_drop(blob):
    path, data = blob
    segments = np.array([[0, 64], [128, 32]], dtype=np.int64)
    for reader in readers():
        f = reader.open(str(path))
        staging = reader.staging(3, STRIDE)
        ids = np.array([2, 5, 7, 1], dtype=np.int64)
        assert staging.stage(4, f, ids, ids * STRIDE) == 3  # capacity 3
        assert staging.stage(4, f, ids[:1], ids[:1] * STRIDE) == 0  # already staged
        reader.drain()  # a read not started would be cancelled by take()
        dst = [np.zeros(64, np.uint8), np.zeros(32, np.uint8)]
        row = np.array([d.ctypes.data for d in dst], np.int64)
        crc = staging.take(4, 5, segments, row, True)
        assert dst[0].tobytes() == data[5 * STRIDE : 5 * STRIDE + 64].tobytes()
        assert crc == zlib.crc32(data[5 * STRIDE + 128 : 5 * STRIDE + 160].tobytes(),
                                 zlib.crc32(dst[0].tobytes()))
        assert staging.take(4, 1, segments, row, False) is None  # never staged
        assert staging.drop(4) == 2
        # Dropped buffers come back once their reads finish.
        issued, deadline = 0, time.monotonic() + 5
        while issued < 3 and time.monotonic() < deadline:
            issued += staging.stage(5, f, ids[:3], ids[:3] * STRIDE)
        assert issued == 3
        assert staging.drop(5) == 3
        reader.close()


def test_python_staging_cancels_reads_not_started(blob):
    path, data = blob
    reader = PythonReader(1)
    f = reader.open(str(path))
    staging = reader.staging(4, STRIDE)
    gate = threading.Event()
    reader.submit(gate.wait, 10)  # holds the one background thread
    ids = np.array([1, 2, 3], dtype=np.int64)
    assert staging.stage(0, f, ids, ids * STRIDE) == 3
    segments = np.array([[0, 64]], dtype=np.int64)
    dst = np.zeros(64, np.uint8)
    row = np.array([dst.ctypes.data], np.int64)
    # Not started: cancelled, so the caller's demand read goes first.
    assert staging.take(0, 2, segments, row, False) is None
    assert staging.drop(0) == 2
    gate.set()
    # Every buffer came back (cancelled ones at once): four stage again.
    more = np.array([4, 5, 6, 7], dtype=np.int64)
    deadline = time.monotonic() + 5
    while staging.stage(1, f, more[:1], more[:1] * STRIDE) == 0 and time.monotonic() < deadline:
        pass
    assert staging.stage(1, f, more[1:], more[1:] * STRIDE) == 3
    reader.drain()
    assert staging.take(1, 7, segments, row, False) is not None
    assert dst.tobytes() == data[7 * STRIDE : 7 * STRIDE + 64].tobytes()
    reader.close()


def test_reader_meter_counts_overlapping_reads_once(tmp_path):
    """The busy seconds are the union of the reads' spans: two records read
    at once on a paced disk take one span of both their bytes, not the sum
    of the two reads' waits (1.5 times it), so the rate is the disk's."""
    record = 1 << 20  # large enough for both readers to use their threads
    path = tmp_path / "blob"
    path.write_bytes(np.random.default_rng(0).bytes(2 * record))
    mbps = 20.0
    for reader in _paced_readers(mbps):
        try:
            f = reader.open(str(path))
            assert reader.busy() == (0, 0.0)
            dst = np.zeros((2, record), np.uint8)
            start = time.perf_counter()
            reader.read(f, np.array([0, record]), np.array([[0, record]]),
                        dst.ctypes.data + np.array([[0], [record]]), np.zeros(2, bool), record)
            elapsed = time.perf_counter() - start
            nbytes, busy = reader.busy()
            assert nbytes == 2 * record
            assert dst.tobytes() == path.read_bytes()
            one_span = 2 * record / (mbps * 1e6)
            assert one_span * 0.95 <= busy <= min(elapsed, one_span * 1.25), reader.name
        finally:
            reader.close()


def test_native_is_refused_clearly_when_missing(qwen, monkeypatch):
    import mlx_streaming.io.choice as loader

    monkeypatch.setattr(loader, "load_extension", lambda: (None, "not built (test)"))
    with pytest.raises(mlx_streaming.StreamingError, match="io='python'"):
        mlx_streaming.load(qwen[1], io="native")
    model, _ = mlx_streaming.load(qwen[1], slots_per_layer=4)
    assert mlx_streaming.stats(model)["io"] == "python"
