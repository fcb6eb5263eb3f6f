"""What the row-wise kernel families share: the thread mapping and reductions
(``device``), launch settings (``config``) and the persistent norm backward
(``norm_backward``, its grid in ``norm_backward_grid``)."""
