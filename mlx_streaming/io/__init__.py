"""Reading expert records: what every reader offers (``reader``), the native and
Python readers, which one a load gets (``choice``), their counters (``meters``)."""
