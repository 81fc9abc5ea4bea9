"""Reading experts before their layer asks: which experts to read ahead
(``predict``), what it learns from the running model to read the right
ones and how many (``learn``), whether it pays (``trial``), built by
``factory``."""
