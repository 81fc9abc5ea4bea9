"""``python -m mlx_streaming.predict MODEL``: before a download, whether a
MoE model fits a Mac and how fast it would decode, from its config and
safetensors headers (docs/predict.md)."""
