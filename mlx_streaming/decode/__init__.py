"""Decoding beyond one prompt at a time: batches (``batch``), speculative drafts
checked K at a time (``verify_drafts``), drafts from MTP layers (``mtp``)."""
