"""Decoding beyond one prompt at a time: batches of prompts (``batch``),
speculative drafts checked K at a time (``speculative``) and drafts from a
model's own MTP layers (``mtp``)."""
