"""``python -m mlx_streaming.bench SUBCOMMAND``: measurements of decode,
the cache, reads, prefetch, serving, drafts and quality, each against a
baseline run beside it (docs/benchmarks.md)."""
