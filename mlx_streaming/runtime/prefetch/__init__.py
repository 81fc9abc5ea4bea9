"""Reading experts before their layer asks: which experts to read ahead
(``predict``, ``affinity``), how many and when (``control``, ``bandwidth``,
``calibration``), whether it pays (``switch``), built by ``factory``."""
