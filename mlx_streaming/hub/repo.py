"""Models on the Hugging Face Hub: a repo id becomes something ``load`` runs.

- A repo holding a stream directory (``mlx_streaming convert --upload``):
  config, tokenizer, spine and manifest are downloaded (huggingface_hub's
  ``snapshot_download``); expert records are fetched on first use by HTTP
  range (``reader.RemoteReader``) into a bounded disk cache.
- A plain mlx-lm model repo: converted once, shard by shard
  (``conversion.shards``), into a local stream directory that later runs reuse.

Everything about URLs, revisions, the endpoint and tokens is
huggingface_hub's; this module only decides what to fetch.
"""

import fnmatch
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ..config import StreamConfig
from ..errors import ConfigError, FormatError, first_line
from ..format import EXPERTS_DIR, MANIFEST_NAME, SPINE_DIR, Manifest, blob_path

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
COMMIT = re.compile(r"[0-9a-fA-F]{7,40}")
MANIFEST_FILE = f"{EXPERTS_DIR}/{MANIFEST_NAME}"
# The weight files mlx_lm.load reads from a model directory (its glob; it
# reads no index).
WEIGHT_FILES = "model*.safetensors"
# A default disk cache takes at most this share of the free space.
DEFAULT_DISK_SHARE = 0.5


def looks_like_repo_id(name: str) -> bool:
    """Spelled ``org/name``, as a repo id is."""
    return bool(REPO_ID.fullmatch(name))


def is_repo_id(name: str) -> bool:
    """``org/name`` that is not a local path."""
    return looks_like_repo_id(name) and not Path(name).expanduser().exists()


def cache_root(config: StreamConfig) -> Path:
    if config.disk_cache_dir is not None:
        return Path(config.disk_cache_dir).expanduser()
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "mlx_streaming"


@dataclass(frozen=True)
class HubRepo:
    """A resolved repo: its id, the commit a revision names, and its files
    (path -> size)."""

    repo_id: str
    commit: str
    files: Optional[Dict[str, int]]  # None when offline (from the local cache)
    endpoint: Optional[str]

    @property
    def is_stream(self) -> bool:
        return self.files is not None and MANIFEST_FILE in self.files

    @property
    def weight_files(self) -> List[str]:
        """The files mlx_lm.load would read weights from, in a download of
        the repo: top-level ``model*.safetensors``, whether an index names
        them or not."""
        return sorted(f for f in self.files or () if "/" not in f
                      and fnmatch.fnmatchcase(f, WEIGHT_FILES))

    def url(self, filename: str) -> str:
        from huggingface_hub import hf_hub_url

        return hf_hub_url(self.repo_id, filename, revision=self.commit, endpoint=self.endpoint)


def resolve(repo_id: str, revision: Optional[str], endpoint: Optional[str]) -> HubRepo:
    """The commit ``revision`` (default: main) names, and its file list.

    Raises:
        FormatError: no such repo or revision, or the Hub cannot be reached.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint)
    where = endpoint or api.endpoint
    try:
        info = api.model_info(repo_id, revision=revision)
        files = {f.path: f.size for f in api.list_repo_tree(
            repo_id, recursive=True, revision=info.sha) if isinstance(f, RepoFile)}
    except GatedRepoError:
        raise FormatError(f"{repo_id} is gated: accept its terms on the Hub and log in "
                          "(`hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise FormatError(f"{repo_id} has no revision {revision!r} on {where}") from None
    except RepositoryNotFoundError:
        raise FormatError(
            f"{repo_id} is neither a local directory nor a model repo on {where} (a private "
            "repo needs `hf auth login` or HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise FormatError(f"the Hub at {where} refused {repo_id}: {first_line(e)}") from None
    except Exception as e:  # network errors come as httpx's
        raise HubUnreachable(f"cannot reach the Hub at {where} for {repo_id} "
                             f"({type(e).__name__}: {first_line(e)}); check the network") from None
    return HubRepo(repo_id, info.sha, files, endpoint)


class HubUnreachable(FormatError):
    """The Hub did not answer (a network error, not a refusal)."""


def download_metadata(repo: HubRepo, config: StreamConfig, dense: bool = True) -> Path:
    """Config, tokenizer, spine and manifest of a stream repo; every file
    but the blobs (and, without ``dense``, but the dense records: a split
    model's rank fetches its own with ``download_dense``). Returns the
    local directory (huggingface_hub's cache layout under
    ``disk_cache_dir/hub``)."""
    ignore = [f"{EXPERTS_DIR}/*.blob"] + ([] if dense else [f"{SPINE_DIR}/*.blob"])
    return _snapshot(repo, config, ignore_patterns=ignore)


def download_dense(repo: HubRepo, config: StreamConfig, specs) -> Path:
    """The dense records of ``specs`` (``DenseSpec``s) into the same
    directory as ``download_metadata``'s."""
    return _snapshot(repo, config, allow_patterns=[f"{SPINE_DIR}/{d.file}" for d in specs]
                     or ["config.json"])


def _snapshot(repo: HubRepo, config: StreamConfig, **patterns) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            repo.repo_id, revision=repo.commit, endpoint=repo.endpoint,
            cache_dir=str(cache_root(config) / "hub"), etag_timeout=config.fetch_timeout,
            **patterns))
    except Exception as e:
        raise FormatError(f"cannot download {repo.repo_id} ({type(e).__name__}: {first_line(e)}); "
                          "check the network and the disk") from None


def check_remote_blobs(repo: HubRepo, manifest: Manifest) -> None:
    """Each blob the manifest names is in the repo and long enough."""
    if repo.files is None:
        return  # offline: the fetches will tell
    for spec in manifest.layers:
        name = f"{EXPERTS_DIR}/{spec.file}"
        size = repo.files.get(name)
        if size is None:
            raise FormatError(f"{repo.repo_id} lacks {name}, which its manifest names; "
                              "re-upload the stream directory")
        if size < spec.blob_nbytes:
            raise FormatError(f"{repo.repo_id}: {name} is {size} bytes, the manifest says "
                              f"{spec.blob_nbytes}; re-upload the stream directory")


def default_disk_cache_bytes(root: Path, manifest: Manifest, cached: int) -> int:
    """Half the space of the disk holding ``root`` that is free or already
    the cache's (``cached`` bytes, so the default does not shrink run after
    run), at most every record."""
    free = shutil.disk_usage(root).free + cached
    return int(min(records_nbytes(manifest), DEFAULT_DISK_SHARE * free))


def records_nbytes(manifest: Manifest) -> int:
    """Bytes of all expert records as the disk cache keeps them (padded)."""
    return sum(spec.blob_nbytes for spec in manifest.layers)


def _check_no_pace(config: StreamConfig) -> None:
    if config.read_pace_mbps is not None:
        raise ConfigError("read_pace_mbps emulates a slower local disk; a Hub repo's records "
                          "come from the network: download it (or convert it) and load the "
                          "directory to pace its reads")


def make_remote_reader(repo: HubRepo, local: Path, manifest: Manifest, config: StreamConfig):
    """The reader of a stream repo: range requests plus the disk cache."""
    from huggingface_hub.utils import build_hf_headers

    _check_no_pace(config)

    from .disk_cache import open_cache
    from .ranges import RangeFetcher
    from .remote import RemoteBlob, RemoteReader

    root = cache_root(config)
    cache = None
    if config.disk_cache_gb is None:
        # Opened uncapped: its scan measures what it holds, then the cap is set.
        cache = open_cache(root / "records", records_nbytes(manifest))
        cache.set_cap(default_disk_cache_bytes(root, manifest, cache.used))
    elif config.disk_cache_gb > 0:
        cache = open_cache(root / "records", int(config.disk_cache_gb * 1e9))
    prefix = f"{repo.repo_id.replace('/', '--')}/{repo.commit}"
    blobs = {
        str(blob_path(local, spec)): RemoteBlob(
            repo.url(f"{EXPERTS_DIR}/{spec.file}"), spec, f"{prefix}/{spec.file}")
        for spec in manifest.layers
    }
    fetcher = RangeFetcher(build_hf_headers(), config.fetch_timeout, config.fetch_retries)
    return RemoteReader(blobs, fetcher, cache, config.fetch_threads)


def open_model(name: str, revision: Optional[str], config: StreamConfig, dense: bool = True):
    """A repo id as ``(local directory, repo or None)``: the repo when its
    experts are to be fetched, None when the directory has everything (a
    converted plain model). Without ``dense``, a stream repo's dense
    records are left to fetch (``download_dense``)."""
    try:
        repo = resolve(name, revision, config.endpoint)
    except HubUnreachable as e:
        return _offline(name, revision, config, e)
    if repo.is_stream:
        _check_no_pace(config)  # before the spine's download
        return download_metadata(repo, config, dense), repo
    if "config.json" not in repo.files or not repo.weight_files:
        raise FormatError(f"{name} is neither a stream directory nor an mlx-lm model "
                          f"(no {MANIFEST_FILE}, config.json or {WEIGHT_FILES} files)")
    from ..conversion.shards import convert_repo

    dst = cache_root(config) / "converted" / f"{name.replace('/', '--')}--{repo.commit}"
    return convert_repo(repo, dst), None


def _offline(name: str, revision: Optional[str], config: StreamConfig, error: Exception):
    """What an earlier run left in ``disk_cache_dir`` when the Hub cannot be
    reached: a converted model, or a stream repo's metadata (then records
    the disk cache lacks fail to fetch)."""
    from huggingface_hub.file_download import repo_folder_name

    root = cache_root(config)
    prefix = f"{name.replace('/', '--')}--"
    converted = [d for d in (root / "converted").glob(prefix + "*")
                 if (d / MANIFEST_FILE).is_file() and _names(d.name[len(prefix):], revision)]
    if converted:
        dst = max(converted, key=lambda d: d.stat().st_mtime)
        warnings.warn(f"{error}; running {name} as converted earlier ({dst.name})",
                      RuntimeWarning, stacklevel=4)
        return dst, None
    # Metadata is downloaded by commit, so huggingface_hub keeps no ref to
    # look up: take the snapshot of that commit, or the latest one.
    snapshots = root / "hub" / repo_folder_name(repo_id=name, repo_type="model") / "snapshots"
    found = [d for d in snapshots.glob("*") if (d / MANIFEST_FILE).is_file()
             and _names(d.name, revision)]
    if not found:
        raise HubUnreachable(f"{error}, or the path: {name} is not a local directory "
                             "either") from None
    local = max(found, key=lambda d: d.stat().st_mtime)
    warnings.warn(f"{error}; running {name} at commit {local.name} from the local cache: "
                  "experts not in the disk cache cannot be fetched", RuntimeWarning,
                  stacklevel=4)
    return local, HubRepo(name, local.name, None, config.endpoint)


def _names(commit: str, revision: Optional[str]) -> bool:
    """Whether ``revision`` may name ``commit`` offline: a commit hash (or
    a prefix of 7 or more of its digits) must match; a branch or tag
    cannot be resolved without the Hub, so any cached commit may serve
    (the latest is taken, and the warning names it)."""
    if revision is None or not COMMIT.fullmatch(revision):
        return True
    return len(revision) >= 7 and commit.startswith(revision.lower())


def check_revision_use(name: str, revision: Optional[str]) -> None:
    if revision is not None:
        raise ConfigError(
            f"revision applies to Hugging Face repo ids, and {name} is a local directory")
