"""Whole-directory checks against the manifest's checksums (the
``mlx_streaming check`` command).
"""

from pathlib import Path
from typing import List, Tuple

from ..errors import FormatError
from .files import (
    blob_path,
    check_blob_size,
    crc_or_none,
    dense_checksum,
    read_dense,
    read_manifest,
)
from .layout import SPINE_DIR, DenseSpec, LayerSpec, Manifest, record_checksum


def checked_dense(manifest: Manifest, rank=None) -> Tuple[DenseSpec, ...]:
    """The dense records ``damaged_spine`` checks: every rank's, or one's."""
    if not manifest.dense_ranks:
        return manifest.dense
    if rank is not None:
        return manifest.dense_ranks[rank]
    return tuple(d for specs in manifest.dense_ranks for d in specs)


def damaged_spine(path, manifest: Manifest, rank=None) -> List[str]:
    """Names of the spine files that are missing or fail their checksums
    (of the dense records, one tensor-parallel rank's where given)."""
    bad = []
    for s in manifest.spine + ((manifest.mtp.spine,) if manifest.mtp else ()):
        f = Path(path) / s.name
        if not f.is_file() or f.stat().st_size != s.nbytes or crc_or_none(f) != s.crc32:
            bad.append(s.name)
    for d in checked_dense(manifest, rank):
        try:
            ok = dense_checksum(read_dense(path, d), d) == d.crc32
        except (OSError, FormatError):
            ok = False
        if not ok:
            bad.append(f"{SPINE_DIR}/{d.file}")
    return bad


def checked_layers(path, rank=None):
    """The expert layers whose records ``damaged_records`` checks: every
    one with the low-bit copies, or one tensor-parallel rank's (its blobs
    alone need be there).

    Raises:
        FormatError: a blob missing or short, or no such rank.
    """
    manifest = read_manifest(path, blobs=rank is None, dense=False)
    if rank is None:
        for spec in manifest.low_layers():
            check_blob_size(path, spec)
        return manifest.expert_layers() + manifest.low_layers()
    if not 0 <= rank < len(manifest.ranks):
        raise FormatError(f"{path} holds no tensor-parallel rank {rank} (it was converted for "
                          f"{manifest.tensor_parallel} rank(s))")
    own = manifest.ranks[rank] + tuple(spec for c in manifest.low_bits for spec in c.ranks[rank])
    for spec in own:
        check_blob_size(path, spec)
    return own


def damaged_records(path, progress=None, rank=None) -> List[Tuple[int, int]]:
    """Check every expert record (or one tensor-parallel rank's) against
    its checksum.

    Returns:
        ``(layer, expert)`` of every record whose checksum does not match.
    """
    return [(spec.layer, e) for spec, e in damaged_experts(path, progress, rank)]


def damaged_experts(path, progress=None, rank=None) -> List[Tuple[LayerSpec, int]]:
    """``damaged_records`` with each record's layer entry, which tells a
    record from its low-bit copy (``LayerSpec.copy_bits``)."""
    bad = []
    for spec in checked_layers(path, rank):
        with open(blob_path(path, spec), "rb", buffering=0) as f:
            buf = bytearray(spec.stride)
            view = memoryview(buf)
            for e in range(spec.num_experts):
                f.seek(spec.record_offset(e))
                f.readinto(view)
                segs = (view[s.offset : s.offset + s.nbytes] for s in spec.segments)
                if record_checksum(segs) != spec.checksums[e]:
                    bad.append((spec, e))
                if progress is not None:
                    progress(1)
    return bad
