"""The dense spine of a version-2 stream directory, layer by layer: pinned
layers read once at load, the others streamed through a ring of layer
buffers under the slot pool's rule (docs/spine.md)."""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import ExpertReadError, FormatError
from ..format import DenseSpec, dense_checksum, dense_path, dtype_from_name
from ..io.python import buffer_at
from ..models.discover import get_module, parent_path
from .store import BlobWatch
from .wrap import hook_calls


def typed_views(raw: mx.array, spec: DenseSpec) -> Dict[str, mx.array]:
    """The layer's tensors as evaluated arrays sharing ``raw``'s memory (uint8,
    at least ``spec.nbytes``): a read into ``raw`` changes them with no copy."""
    views = {
        s.name: raw[s.offset:s.offset + s.nbytes].view(dtype_from_name(s.dtype)).reshape(s.shape)
        for s in spec.segments
    }
    mx.eval(list(views.values()))
    return views


def bindings(model: nn.Module, spec: DenseSpec) -> List[Tuple[nn.Module, str, str]]:
    """``(module, attribute, segment name)`` of each tensor, checked against the model."""
    out = []
    for s in spec.segments:
        full = f"{spec.prefix}.{s.name}"
        try:
            module = get_module(model, parent_path(full))
            want = module[full.rsplit(".", 1)[1]]
        except (KeyError, IndexError, ValueError, AttributeError):
            raise FormatError(f"the dense record of layer {spec.layer} holds {full}, which "
                              "the model does not have; re-convert the model") from None
        dtype = dtype_from_name(s.dtype)
        floating = mx.issubdtype(dtype, mx.floating) and mx.issubdtype(want.dtype, mx.floating)
        if tuple(want.shape) != s.shape or not (floating or want.dtype == dtype):
            raise FormatError(
                f"{full} is {s.dtype} {s.shape} in the dense record but {want.dtype} "
                f"{tuple(want.shape)} in the model; re-convert the model")
        out.append((module, full.rsplit(".", 1)[1], s.name))
    return out


def bind(pairs, views: Dict[str, mx.array]) -> None:
    for module, key, name in pairs:
        module[key] = views[name]


def read_into(reader, file: int, spec: DenseSpec, address: int, checksum: bool) -> int:
    """Read ``spec``'s record to the buffer at ``address``; its CRC-32 if asked."""
    segments = np.array([(s.offset, s.nbytes) for s in spec.segments], dtype=np.int64)
    dst = (address + segments[:, 0]).reshape(1, -1).astype(np.int64)
    crcs = reader.read(file, np.zeros(1, dtype=np.int64), segments, dst,
                       np.array([checksum]), spec.nbytes)
    return int(crcs[0])


def record_crc(address: int, spec: DenseSpec) -> int:
    """CRC-32 of a record's segments in memory at ``address``."""
    return dense_checksum(buffer_at(address, spec.nbytes), spec)


def _check_crc(spec: DenseSpec, crc: int) -> None:
    if crc != spec.crc32:
        raise FormatError(f"the dense record of layer {spec.layer} ({spec.file}) fails its "
                          "checksum; the file is damaged, re-convert the model")


def load_pinned(model: nn.Module, path, spec: DenseSpec, reader, checksums: str) -> int:
    """Read a pinned layer's record into arrays of its own, bound; returns its bytes."""
    pairs = bindings(model, spec)
    raw = mx.zeros((spec.nbytes,), dtype=mx.uint8)
    mx.eval(raw)
    view = np.array(raw, copy=False)
    assert view.flags.c_contiguous and view.flags.writeable
    file = reader.open(str(dense_path(path, spec)))
    crc = read_into(reader, file, spec, view.ctypes.data, checksums != "off")
    if checksums != "off":
        _check_crc(spec, crc)
    bind(pairs, typed_views(raw, spec))
    return spec.nbytes


@dataclass
class RingStats:
    reads: int = 0
    bytes: int = 0
    preloaded: int = 0  # layers whose read was started before they were needed
    # Seconds the pass waited for a layer's bytes (earlier layers may still compute).
    wait_s: float = 0.0

    def report(self) -> dict:
        return {"reads": self.reads, "read_gb": self.bytes / 1e9,
                "preloaded": self.preloaded, "wait_s": self.wait_s}


class SpineRing:
    """Layer buffers the streamed layers take turns in: ``before(layer)`` binds
    the layer to a buffer holding its bytes; ``after(layer, out)`` starts its
    compute and reads the next layers into buffers whose readers are evaluated."""

    def __init__(self, model: nn.Module, path, specs: Sequence[DenseSpec], buffers: int,
                 reader, checksums: str):
        self.specs = {s.layer: s for s in specs}
        self.order = [s.layer for s in specs]
        self.position = {layer: i for i, layer in enumerate(self.order)}
        self.reader = reader
        self.checksums = checksums
        buffers = max(1, min(buffers, len(specs)))
        nbytes = max(s.nbytes for s in specs)
        self.raw = [mx.zeros((nbytes,), dtype=mx.uint8) for _ in range(buffers)]
        mx.eval(self.raw)
        arrays = [np.array(r, copy=False) for r in self.raw]
        assert all(a.flags.c_contiguous and a.flags.writeable for a in arrays)
        self.address = [a.ctypes.data for a in arrays]
        self.nbytes = buffers * nbytes
        self.pairs = {s.layer: bindings(model, s) for s in specs}
        self.views = [{s.layer: typed_views(r, s) for s in specs} for r in self.raw]
        self.files = {s.layer: reader.open(str(dense_path(path, s))) for s in specs}
        # A record changed on disk after its first check is checked again.
        self.watches = ({s.layer: BlobWatch(dense_path(path, s)) for s in specs}
                        if checksums == "first-read" else {})
        self.held: List[Optional[int]] = [None] * buffers
        self.future: List[Optional[Future]] = [None] * buffers
        self.pending: List[list] = [[] for _ in range(buffers)]
        self.checked = set()  # layers whose record passed its first-read check
        self.current: Optional[int] = None
        self.stats = RingStats()
        self.closed = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlxs-spine")
        for layer in self.order:
            bind(self.pairs[layer], self.views[0][layer])  # lazy inits never evaluated

    @property
    def buffers(self) -> int:
        return len(self.raw)

    def before(self, layer: int) -> None:
        if self.closed:
            raise ExpertReadError("this model was closed; load it again to use it")
        b = self._holding(layer)
        if b is None:
            b = self._victim(exclude={self.current})
            self._start(b, layer)
        elif self.future[b] is not None:
            self.stats.preloaded += 1
        if self.future[b] is not None:
            self._wait(b, layer)
        bind(self.pairs[layer], self.views[b][layer])
        self.current = b

    def _wait(self, b: int, layer: int) -> None:
        """Wait for buffer ``b``'s read of ``layer`` and check it."""
        start = time.perf_counter()
        try:
            crc = self.future[b].result()
        except BaseException:
            self.held[b] = self.future[b] = None
            raise
        finally:
            self.stats.wait_s += time.perf_counter() - start
        self.future[b] = None
        if crc is not None:
            try:
                _check_crc(self.specs[layer], crc)
            except FormatError:
                self.held[b] = None
                self.checked.discard(layer)  # every read is checked until one passes
                raise
            self.checked.add(layer)

    def after(self, layer: int, out, caches=()) -> None:
        """``out`` and ``caches`` (what the layer wrote there, which may not all
        feed ``out``: DeepSeek-V3.2's indexer keys) read the layer's buffer."""
        b = self.current
        arrays = _arrays(out) + [a for c in caches for a in _cache_arrays(c)]
        self.pending[b].extend(arrays)
        if len(self.pending[b]) > MAX_PENDING:
            mx.eval(self.pending[b])
            self.pending[b] = []
        # The layer computes while the next layers are read.
        mx.async_eval(arrays)
        i = self.position[layer]
        upcoming = [self.order[(i + j) % len(self.order)] for j in range(1, self.buffers)]
        for target in upcoming:
            if target == layer or self._holding(target) is not None:
                continue
            victim = self._victim(exclude={b} | {self._holding(t) for t in upcoming})
            if victim is None:
                break
            self._start(victim, target)

    def failed(self) -> None:
        """The running layer raised: what it left unevaluated may still read its
        buffer, so the buffer is retired for a fresh one."""
        b = self.current
        if b is None:
            return
        self.raw[b] = mx.zeros((self.raw[b].size,), dtype=mx.uint8)
        mx.eval(self.raw[b])
        self.address[b] = np.array(self.raw[b], copy=False).ctypes.data
        self.views[b] = {s.layer: typed_views(self.raw[b], s) for s in self.specs.values()}
        self.held[b] = self.future[b] = None
        self.pending[b] = []
        self.current = None

    def _holding(self, layer: int) -> Optional[int]:
        for b, held in enumerate(self.held):
            if held == layer:
                return b
        return None

    def _victim(self, exclude) -> Optional[int]:
        free = [b for b in range(self.buffers) if b not in exclude]
        if not free:
            return None if exclude != {self.current} else self.current
        return free[0]

    def _start(self, b: int, layer: int) -> None:
        """Read ``layer`` into buffer ``b`` in the background, once nothing reads ``b``."""
        self._release(b)
        spec = self.specs[layer]
        check = self.checksums == "always" or (self.checksums == "first-read"
                                              and layer not in self.checked)
        self.held[b] = layer
        self.future[b] = self._executor.submit(self._read, b, layer, check)
        self.stats.reads += 1
        self.stats.bytes += spec.nbytes

    def _read(self, b: int, layer: int, check: bool) -> Optional[int]:
        spec = self.specs[layer]
        crc = read_into(self.reader, self.files[layer], spec, self.address[b], check)
        if check:
            return crc
        if layer in self.watches and self.watches[layer].changed():
            return record_crc(self.address[b], spec)  # rewritten since its last check
        return None

    def _release(self, b: int) -> None:
        """Wait until no read writes and no computation reads buffer ``b``."""
        if self.future[b] is not None:
            try:
                self.future[b].result()
            except Exception:
                pass  # the bytes are discarded either way
            self.future[b] = None
        self.held[b] = None
        if self.pending[b]:
            mx.eval(self.pending[b])
            self.pending[b] = []
        if self.current == b:
            self.current = None

    def reset_stats(self) -> None:
        self.stats = RingStats()

    def finish(self) -> None:
        """Evaluate what still reads a buffer (another thread may call next)."""
        for b in range(self.buffers):
            if self.pending[b]:
                mx.eval(self.pending[b])
                self.pending[b] = []

    def close(self) -> None:
        self.closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)


# A buffer kept pass after pass evaluates its readers beyond this many arrays.
MAX_PENDING = 256


def _arrays(tree) -> List[mx.array]:
    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def _cache_arrays(cache) -> List[mx.array]:
    """The arrays a layer's cache holds (an empty cache has none)."""
    try:
        return _arrays(cache.state)
    except Exception:  # a cache not yet written (its state is None)
        return []


def _caches(args, kwargs) -> list:
    """The cache objects among a layer call's arguments."""
    return [a for a in (*args, *kwargs.values()) if hasattr(a, "update_and_fetch")
            or hasattr(a, "state") and not isinstance(a, mx.array)]


def stream_layer(module: nn.Module, ring: SpineRing, layer: int) -> None:
    """Make ``module`` (a decoder layer) take its weights from ``ring`` per call."""

    def from_ring(call, *args, **kwargs):
        ring.before(layer)
        try:
            out = call(*args, **kwargs)
        except BaseException:
            ring.failed()
            raise
        ring.after(layer, out, _caches(args, kwargs))
        return out

    hook_calls(module, from_ring)
