"""Models on the Hugging Face Hub: stream directories read by HTTP range
with a disk cache, and plain mlx-lm repos converted shard by shard."""

from .repo import (  # noqa: F401
    HubRepo,
    cache_root,
    check_remote_blobs,
    check_revision_use,
    download_dense,
    is_repo_id,
    looks_like_repo_id,
    make_remote_reader,
    open_model,
)
