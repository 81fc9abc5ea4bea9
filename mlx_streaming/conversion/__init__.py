"""Conversion of mlx-lm models into stream directories: from a local
directory or a Hub repo (``local``), shard by shard from a Hub repo
(``shards``), and the command line (``command``)."""
