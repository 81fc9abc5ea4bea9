"""The files of a stream directory: where each lives, and the checks that
a directory is complete before anything reads it.
"""

import json
import math
import os
import struct
import zlib
from pathlib import Path
from typing import List, Optional, Tuple

from ..errors import CorruptExpertError, FormatError
from .layout import (
    CONVERT_STATE_NAME,
    EXPERTS_DIR,
    FORMAT_NAME,
    MANIFEST_NAME,
    MAX_DIM,
    READ_VERSIONS,
    SPINE_DIR,
    DenseSpec,
    LayerSpec,
    Manifest,
    SpineFile,
    record_checksum,
)
from .parse import Malformed, get_field, manifest_from_dict, manifest_to_dict


def experts_dir(path) -> Path:
    return Path(path) / EXPERTS_DIR


def manifest_path(path) -> Path:
    return experts_dir(path) / MANIFEST_NAME


# A tokenizer's vocabulary, in the files tokenizers load it from.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.model.*", "vocab.json",
                    "spiece.model", "tekken.json", "*tiktoken*")


# Files of a source model that the tokenizer may read, copied by convert.
TOKENIZER_PATTERNS = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.jsonl")


def has_vocabulary(path: Path) -> bool:
    """Whether a model directory holds a tokenizer's vocabulary."""
    return any(f.is_file() for pattern in VOCABULARY_FILES for f in path.glob(pattern))


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a crash leaves either the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (so that renames in it are durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path, manifest: Manifest) -> None:
    write_json_atomic(manifest_path(path), manifest_to_dict(manifest))


def read_manifest(path, blobs: bool = True, dense: bool = True) -> Manifest:
    """Read and validate ``experts/manifest.json`` of a stream directory
    (and, with ``blobs``, that each blob is there and long enough; with
    ``dense``, each dense record).

    Raises:
        FormatError: the directory is not a complete stream directory of a
            version this package reads.
    """
    mpath = manifest_path(path)
    if not mpath.exists():
        if (Path(path) / CONVERT_STATE_NAME).exists():
            raise FormatError(
                f"the conversion into {path} did not finish; run the same "
                "`mlx_streaming convert` command again to complete it"
            )
        if (Path(path) / "config.json").exists():
            raise FormatError(
                f"{path} is not a converted stream directory (no {EXPERTS_DIR}/"
                f"{MANIFEST_NAME}); run `mlx_streaming convert --model {path} "
                "--out DIR` first, or re-run an interrupted conversion"
            )
        raise FormatError(f"{path} does not exist or is not a model directory")
    try:
        with open(mpath, "rb") as f:
            d = json.loads(f.read().decode("utf-8"))
    except IsADirectoryError:
        raise FormatError(f"{mpath} is a directory, not a manifest; re-convert the model") from None
    except OSError as e:
        raise FormatError(f"cannot read {mpath}: {e.strerror}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(
            f"{mpath} is not valid JSON ({type(e).__name__}); re-convert the model"
        ) from None
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        raise FormatError(f"{mpath} is not an mlx_streaming manifest; re-convert the model")
    version = d.get("version")
    if version not in READ_VERSIONS or isinstance(version, bool):
        raise FormatError(
            f"{mpath} has format version {version!r}, this mlx_streaming reads "
            f"versions {', '.join(map(str, READ_VERSIONS))}; upgrade mlx_streaming or re-convert"
        )
    try:
        manifest = manifest_from_dict(d)
    except Malformed as e:
        raise FormatError(f"{mpath} is malformed ({e}); re-convert the model") from None
    if blobs:
        for spec in manifest.expert_layers():
            check_blob_size(path, spec)
    for spec in manifest.dense if dense else ():
        check_dense_size(path, spec)
    return manifest


def spine_dir(path) -> Path:
    return Path(path) / SPINE_DIR


def dense_path(path, spec: DenseSpec) -> Path:
    return spine_dir(path) / spec.file


def check_dense_size(path, spec: DenseSpec) -> None:
    f = dense_path(path, spec)
    try:
        size = f.stat().st_size
    except FileNotFoundError:
        raise FormatError(f"layer {spec.layer}: dense record {f} is missing; "
                          "re-convert the model") from None
    if size < spec.nbytes:
        raise FormatError(f"layer {spec.layer}: dense record {f} is truncated ({size} of "
                          f"{spec.nbytes} bytes); re-convert the model")


def read_dense(path, spec: DenseSpec) -> bytearray:
    """A whole dense record (for checks and tools, not the hot path)."""
    buf = bytearray(spec.nbytes)
    with open(dense_path(path, spec), "rb", buffering=0) as f:
        n = f.readinto(memoryview(buf))
    if n != spec.nbytes:
        raise FormatError(f"layer {spec.layer}: dense record is truncated; re-convert")
    return buf


def dense_checksum(record, spec: DenseSpec) -> int:
    view = memoryview(record)
    return record_checksum(view[s.offset : s.offset + s.nbytes] for s in spec.segments)


def blob_path(path, spec: LayerSpec) -> Path:
    return experts_dir(path) / spec.file


def write_copies_command(path, bits, force: bool = False) -> str:
    """The command that writes the ``bits``-bit copies (a width, or widths
    as ``2,3``) of the stream directory ``path`` again (``force``: whole
    ones too, e.g. damaged)."""
    return (f"`python -m mlx_streaming.convert --out {path} --miss-bits {bits}"
            f"{' --force' if force else ''}`")


def check_blob_size(path, spec: LayerSpec) -> None:
    bpath = blob_path(path, spec)
    bits = spec.copy_bits
    what = "blob" if bits is None else f"blob of the {bits}-bit copies"
    advice = "re-convert the model" if bits is None else \
        f"write the copies again with {write_copies_command(path, bits)}"
    try:
        size = bpath.stat().st_size
    except FileNotFoundError:
        raise FormatError(f"layer {spec.layer}: {'expert ' if bits is None else ''}{what} "
                          f"{bpath} is missing; {advice}") from None
    if size < spec.blob_nbytes:
        first_bad = size // spec.stride
        raise CorruptExpertError(
            spec.layer,
            first_bad,
            f"{what} {bpath} is truncated ({size} of {spec.blob_nbytes} bytes)",
            advice,
        )


# safetensors dtypes that MLX loads, and their item sizes.
SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
}


# A header larger than this is damage, not a model (safetensors' own cap).
MAX_SAFETENSORS_HEADER = 100 << 20


SPINE_PATTERN = "model*.safetensors"


def spine_files(path) -> List[Path]:
    return sorted(Path(path).glob(SPINE_PATTERN))


def check_safetensors(path: Path) -> None:
    """Check a safetensors file's header against the file before MLX reads
    it: a damaged header must be a one-line error, never a crash.

    Raises:
        FormatError: the header is unreadable or names bytes the file lacks.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if n < 0 or n > min(size - 8, MAX_SAFETENSORS_HEADER):
                raise Malformed(f"header length {n} does not fit the {size}-byte file")
            header = json.loads(f.read(n).decode("utf-8"))
        data = size - 8 - n
        if not isinstance(header, dict):
            raise Malformed("the header is not a JSON object")
        for name, t in header.items():
            if name == "__metadata__":
                meta = {} if t is None else t  # MLX writes null when there is none
                if not isinstance(meta, dict) or not all(
                        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
                    raise Malformed("__metadata__ is not a map of strings")
                continue
            dtype = get_field(t, "dtype", str, name)
            if dtype not in SAFETENSORS_ITEMSIZE:
                raise Malformed(f"{name} has unknown dtype {dtype!r}")
            shape = get_field(t, "shape", list, name)
            offsets = get_field(t, "data_offsets", list, name)
            ints = shape + offsets
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
                raise Malformed(f"{name} has a negative or non-integer shape or offset")
            if any(n >= MAX_DIM for n in shape):
                raise Malformed(f"{name} has a dimension of {max(shape)}")
            if len(offsets) != 2 or not offsets[0] <= offsets[1] <= data:
                raise Malformed(f"{name}'s bytes {offsets} lie outside the file")
            if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_ITEMSIZE[dtype]:
                raise Malformed(f"{name}'s {offsets[1] - offsets[0]} bytes do not hold "
                                 f"a {dtype} tensor of shape {shape}")
    except OSError as e:
        raise FormatError(f"cannot read spine file {path}: {e.strerror}") from None
    except (Malformed, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FormatError(
            f"spine file {path} is damaged ({e}); re-convert the model"
        ) from None


def file_crc32(path: Path, chunk: int = 16 << 20) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        view = memoryview(buf)
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return crc & 0xFFFFFFFF


def spine_manifest(path) -> Tuple[SpineFile, ...]:
    """Size and CRC-32 of every spine file (written into the manifest)."""
    return tuple(SpineFile(f.name, f.stat().st_size, file_crc32(f)) for f in spine_files(path))


def check_spine_files(path, manifest: Manifest, checksums: bool) -> None:
    """The spine files the manifest records exist with their sizes (and,
    with ``checksums``, their CRC-32). Manifests without spine entries
    (written before they existed) are not checked.

    Raises:
        FormatError: a spine file is missing, truncated or damaged.
    """
    for s in manifest.spine:
        f = Path(path) / s.name
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise FormatError(f"spine file {f} is missing; re-convert the model") from None
        if size != s.nbytes:
            raise FormatError(f"spine file {f} has {size} bytes, the manifest records "
                              f"{s.nbytes}; re-convert the model")
        if checksums and crc_or_none(f) != s.crc32:
            raise FormatError(f"spine file {f} fails its checksum; re-convert the model")


def crc_or_none(path: Path) -> Optional[int]:
    try:
        return file_crc32(path)
    except OSError:
        return None
