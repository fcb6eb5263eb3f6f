"""Helper imported by ``add_kernel``: editing it must change that family's keys."""

THREADS_PER_ROW = 64
