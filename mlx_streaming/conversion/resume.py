"""A conversion that is killed never leaves a directory that loads, and
running it again finishes it: the state kept while it runs, and the
checks of the destination before anything is written.
"""

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional

from ..errors import ConversionError
from ..format import (
    CONVERT_STATE_NAME,
    MANIFEST_NAME,
    TOKENIZER_PATTERNS,
    LayerSpec,
    experts_dir,
    fsync_path,
    layer_from_dict,
    layer_to_dict,
    manifest_path,
    spine_dir,
    write_json_atomic,
)

SKIP_FILES = {"config.json", "model.safetensors.index.json", CONVERT_STATE_NAME}


def conversion_fingerprint(src: Path, options: dict) -> str:
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for f in sorted(src.glob("*.safetensors")) + [src / "config.json"]:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


class State:
    """Finished layers of an interrupted conversion (``DST/.convert-state.json``)."""

    def __init__(self, dst: Path, fingerprint: str):
        self.path = dst / CONVERT_STATE_NAME
        self.fingerprint = fingerprint
        self.layers: Dict[str, dict] = {}
        saved = _read_json(self.path)
        if saved.get("fingerprint") == fingerprint and isinstance(saved.get("layers"), dict):
            self.layers = saved["layers"]

    def start(self) -> None:
        """Mark the directory as this conversion's before anything is written."""
        write_json_atomic(self.path, {"fingerprint": self.fingerprint, "layers": self.layers})

    def done(self, file: str, dst: Path) -> Optional[LayerSpec]:
        d = self.layers.get(file)
        if d is None:
            return None
        try:
            spec = layer_from_dict(d)
        except Exception:
            return None  # a damaged state entry: redo the layer
        blob = experts_dir(dst) / file
        if not blob.exists() or blob.stat().st_size != spec.blob_nbytes:
            return None
        return spec

    def record(self, spec: LayerSpec) -> None:
        self.layers[spec.file] = layer_to_dict(spec)
        write_json_atomic(self.path, {"fingerprint": self.fingerprint, "layers": self.layers})


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``, or {} when it is missing or damaged."""
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def fsync_written(dst: Path) -> None:
    """Everything the manifest will declare complete is on disk first."""
    for pattern in (*TOKENIZER_PATTERNS, "*.safetensors"):
        for f in dst.glob(pattern):
            if f.is_file():
                fsync_path(f)
    fsync_path(dst)


def clear_dst(dst: Path) -> None:
    """Remove what ``--force`` replaces in a stream or mlx-lm model
    directory: blobs and manifest, spine and index, config, and every file
    of the tokenizer patterns (``*.json``, ``*.txt``, ``*.model``, ...), since
    a stale one would be the new model's. Other files stay."""
    # The manifest goes first: from here on the directory never looks complete.
    manifest_path(dst).unlink(missing_ok=True)
    experts = experts_dir(dst)
    if experts.is_dir():
        for f in experts.iterdir():
            if f.is_file() and (f.suffix in (".blob", ".tmp") or f.name == MANIFEST_NAME):
                f.unlink()
        if not any(experts.iterdir()):
            experts.rmdir()
    if spine_dir(dst).is_dir():
        shutil.rmtree(spine_dir(dst))
    names = {"model.safetensors.index.json", CONVERT_STATE_NAME, "config.json"}
    for pattern in (*TOKENIZER_PATTERNS, "model*.safetensors", "*.tmp*"):
        names.update(f.name for f in dst.glob(pattern) if f.is_file())
    for name in names:
        (dst / name).unlink(missing_ok=True)
    fsync_path(dst)


def check_not_source(src: Path, dst: Path) -> None:
    if dst.exists() and os.path.samefile(src, dst):
        raise ConversionError(
            f"--out {dst} is the source model itself: converting in place would "
            "replace its weights; choose another --out"
        )


def dst_state(dst: Path, fingerprint: str) -> str:
    """What ``dst`` holds: ``"done"`` (this conversion), ``"resume"`` (this
    conversion, interrupted), ``"empty"``, ``"stream"`` (another converted
    or interrupted model), ``"model"`` (an mlx-lm model) or ``"foreign"``."""
    if not dst.exists():
        return "empty"
    if manifest_path(dst).is_file():
        source = _read_json(manifest_path(dst)).get("source")
        done = isinstance(source, dict) and source.get("fingerprint") == fingerprint
        return "done" if done else "stream"
    if (dst / CONVERT_STATE_NAME).exists():
        same = _read_json(dst / CONVERT_STATE_NAME).get("fingerprint") == fingerprint
        return "resume" if same else "stream"
    if (dst / "config.json").exists():
        return "model"
    others = [f for f in dst.iterdir() if f != experts_dir(dst)]
    if others or (experts_dir(dst).is_dir() and any(experts_dir(dst).iterdir())):
        return "foreign"
    return "empty"


def check_dst(dst: Path, state: str, force: bool) -> None:
    """Refuse to write where it would destroy something not asked for.

    ``--force`` replaces another converted model or an mlx-lm model
    directory; a directory of anything else is never written into.
    """
    if state == "foreign":
        raise ConversionError(
            f"{dst} holds files that are not a model; choose an empty or new --out"
        )
    if state in ("stream", "model") and not force:
        what = ("a different converted model" if state == "stream" else "an mlx-lm model")
        raise ConversionError(
            f"{dst} already holds {what}; pass --force to replace it or choose another --out"
        )


def _disk_error(e: OSError, dst: Path) -> ConversionError:
    where = e.filename or dst
    if e.errno == errno.ENOSPC:
        return ConversionError(
            f"the disk holding {dst} is full (writing {where}); free space and run the "
            "same command again: finished layers are kept"
        )
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return ConversionError(
            f"cannot write {where} ({e.strerror}); choose a writable --out"
        )
    return ConversionError(f"cannot write {where} ({e.strerror}); check --out and the disk")


def os_error(e: OSError, src_path: Optional[Path], dst: Path) -> ConversionError:
    failed = Path(e.filename).absolute() if e.filename is not None else None
    if (src_path is not None and failed is not None
            and failed.is_relative_to(src_path.absolute())
            and not failed.is_relative_to(dst.absolute())):
        return ConversionError(f"cannot read {e.filename} of the source model ({e.strerror})")
    return _disk_error(e, dst)
