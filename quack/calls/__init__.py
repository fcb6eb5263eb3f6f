"""Calls: from a torch call to the kernels it needs.

``torch_interop`` checks and views tensors; ``plan`` maps a call's signature to
its kernels; ``manifest`` reads and records signatures; ``fastpath`` repeats an
eager call's launch; ``cute_op`` registers the torch ops torch.compile calls;
``occupancy`` sizes persistent grids.  Below the kernel families, above the
cache (docs/architecture.md).
"""
