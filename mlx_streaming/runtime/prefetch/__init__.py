"""Reading experts before their layer asks: predictions (``predict``), what it
learns (``learn``), whether it pays (``trial``), built by ``factory``."""
