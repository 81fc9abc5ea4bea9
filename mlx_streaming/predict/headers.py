"""What predict reads of a model before any download: ``config.json`` and
each weight file's safetensors header (the 8-byte length, then the header
JSON), by HTTP range for a Hub repo; of a stream directory, its manifest.
Nothing is written to disk.
"""

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..errors import FormatError, StreamingError, first_line
from ..format import (
    EXPERTS_DIR,
    MANIFEST_NAME,
    MAX_DIM,
    MAX_SAFETENSORS_HEADER,
    Malformed,
    Manifest,
    manifest_from_dict,
    read_manifest,
    spine_files,
)
from ..hub.repo import WEIGHT_FILES, HubRepo, is_repo_id, resolve

MANIFEST_FILE = f"{EXPERTS_DIR}/{MANIFEST_NAME}"
# Header reads are small: a few tries, a short wait each.
FETCH_TIMEOUT, FETCH_RETRIES = 20.0, 2


@dataclass(frozen=True)
class ModelFiles:
    """A model as predict sees it: its config, and either its tensors'
    ``(dtype, shape)`` (an mlx-lm model) or its manifest (a stream
    directory, whose spine files weigh ``spine_bytes``)."""

    name: str
    config: dict
    tensors: Dict[str, Tuple[str, Tuple[int, ...]]] = field(default_factory=dict)
    manifest: Optional[Manifest] = None
    spine_bytes: int = 0
    fetched: int = 0  # bytes read over the network


def read_model(name: str, revision: Optional[str] = None,
               endpoint: Optional[str] = None) -> ModelFiles:
    """The config and headers of a local directory or a Hub repo id.

    Raises:
        FormatError: a file is missing or unreadable, or the Hub cannot be
            reached; the message names which.
    """
    if is_repo_id(name):
        return _read(name, _HubFiles(resolve(name, revision, endpoint)))
    path = Path(name).expanduser()
    if not path.is_dir():
        raise FormatError(f"{name} is neither a local directory nor a Hub repo id (org/name)")
    return _read(name, _LocalFiles(path))


def _read(name: str, files) -> ModelFiles:
    config = _json(files, "config.json")
    if MANIFEST_FILE in files.sizes:
        try:
            manifest = (read_manifest(files.root, blobs=False, dense=False) if files.local else
                        manifest_from_dict(_json(files, MANIFEST_FILE)))
        except Malformed as e:
            raise FormatError(f"{name}: {MANIFEST_FILE} cannot be read ({e})") from None
        spine = sum(n for f, n in files.sizes.items() if _is_weight_file(f))
        return ModelFiles(name, config, manifest=manifest, spine_bytes=spine,
                          fetched=files.fetched)
    shards = sorted(f for f in files.sizes if _is_weight_file(f))
    if not shards:
        raise FormatError(f"{name} has no {WEIGHT_FILES} files: predict reads the shapes "
                          "of a model's weights from their safetensors headers")
    tensors = {}
    for shard in shards:
        tensors.update(_header(files, shard))
    return ModelFiles(name, config, tensors=tensors, fetched=files.fetched)


def _is_weight_file(name: str) -> bool:
    return "/" not in name and Path(name).match(WEIGHT_FILES)


def _json(files, name: str) -> dict:
    if name not in files.sizes:
        raise FormatError(f"{files.label} has no {name}")
    try:
        value = json.loads(files.read(name, 0, files.sizes[name]))
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{name} of {files.label} is not JSON ({first_line(e)})") from None
    if not isinstance(value, dict):
        raise FormatError(f"{name} of {files.label} is not a JSON object")
    return value


def _header(files, shard: str) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """``tensor -> (dtype, shape)`` from one safetensors header."""
    size = files.sizes[shard]
    bad = f"{shard} of {files.label} has no readable safetensors header"
    if size < 8:
        raise FormatError(bad)
    (n,) = struct.unpack("<Q", files.read(shard, 0, 8))
    if n > min(size - 8, MAX_SAFETENSORS_HEADER):
        raise FormatError(f"{bad} (its length, {n}, does not fit the file)")
    try:
        header = json.loads(files.read(shard, 8, n))
        tensors = {k: (v["dtype"], tuple(v["shape"]))
                   for k, v in header.items() if k != "__metadata__"}
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise FormatError(f"{bad} ({type(e).__name__})") from None
    for name, (dtype, shape) in tensors.items():
        if not (isinstance(dtype, str) and all(type(d) is int and 0 <= d < MAX_DIM
                                               for d in shape)):
            raise FormatError(f"{bad} ({name} has dtype {dtype!r} and shape {list(shape)})")
    return tensors


class _LocalFiles:
    local, fetched = True, 0

    def __init__(self, root: Path):
        self.root, self.label = root, str(root)
        names = ["config.json", MANIFEST_FILE] + [p.name for p in spine_files(root)]
        self.sizes = {n: (root / n).stat().st_size for n in names if (root / n).is_file()}

    def read(self, name: str, start: int, nbytes: int) -> bytes:
        with open(self.root / name, "rb") as f:
            f.seek(start)
            return f.read(nbytes)


class _HubFiles:
    """Byte ranges of a resolved repo's files, counted."""

    local = False

    def __init__(self, repo: HubRepo):
        from huggingface_hub.utils import build_hf_headers

        from ..hub.ranges import RangeFetcher

        self.repo, self.label, self.root = repo, repo.repo_id, None
        self.sizes = dict(repo.files or {})
        self.fetcher = RangeFetcher(build_hf_headers(), FETCH_TIMEOUT, FETCH_RETRIES)

    @property
    def fetched(self) -> int:
        return self.fetcher.bytes

    def read(self, name: str, start: int, nbytes: int) -> bytes:
        if nbytes == 0:
            return b""
        try:
            return bytes(self.fetcher.fetch(self.repo.url(name), start, nbytes))
        except StreamingError as e:
            raise FormatError(f"cannot read {name} of {self.label}: {first_line(e)}") from None
