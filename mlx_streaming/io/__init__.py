"""Reading expert records from disk: what every reader offers (``reader``),
the native reader and the Python one (``native``, ``python``), which one a
load gets (``choice``), and their byte and time counters (``meters``)."""
