"""Plans: what one call signature needs, decided once per process.

Each public op maps a call to a *signature*: a small frozen dataclass of what
decides its kernels (dtypes, N, vector widths from alignment, flags, whether a
backward will run under the current grad mode).  ``plan_for(signature)``
turns it into a :class:`Plan`, the compiled objects by role ("forward",
"backward", ...), each named by its compile function and arguments (the
object key) and carrying how a call launches it (``quack/calls/launches.py``).
Plans are cached per signature, so a repeated call costs a dictionary lookup.

One plan serves every path: the eager call runs its kernels, the
autograd backward takes its "backward" kernel, compile-only mode warms all
of them (``Plan.warm``), and a manifest (``quack/calls/manifest.py``) is a list of
signatures that tools/warm_cache.py warms through the same plans.  The arch
is not part of a signature: it is part of every object's key, and a plan
refuses a compile target its kernels cannot be built for (``Signature.ARCHS``)
before any DSL code runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import json
import math
import os
import threading
from typing import Any, Callable, ClassVar, Iterator, Optional

from quack.cache import CacheMissError
from quack.calls import recording
from quack.calls.launches import Launch

_SIGNATURES: dict[str, type] = {}  # op name -> signature class
_PLANS: dict[Any, "Plan"] = {}
_LOCK = threading.Lock()

# The compile targets with thread block clusters (Hopper and newer), as the
# CuTe DSL spells them (``cutlass.base_dsl.Arch``) and QUACK_ARCH takes them.
CLUSTER_ARCHS = (
    "sm_90", "sm_90a",
    "sm_100", "sm_100a", "sm_100f", "sm_101", "sm_101a", "sm_101f", "sm_103", "sm_103a", "sm_103f",
    "sm_107", "sm_107a", "sm_107f", "sm_110", "sm_110a", "sm_110f",
    "sm_120", "sm_120a", "sm_120f", "sm_121", "sm_121a", "sm_121f",
)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One compiled object, a ``jit_cache`` compile function and its
    arguments, and how a call launches it (``launch``, ``run``)."""

    compile: Callable
    args: tuple
    launch: Optional[Launch] = None
    # The manifest line of the plan that holds it, for a strict-mode miss.
    origin: str = dataclasses.field(default="", compare=False)

    def load(self):
        """The launchable handle (compiled or exported on a miss; a no-op in
        compile-only mode).  A strict-mode miss names the manifest entry that
        would have warmed it."""
        try:
            return self.compile(*self.args)
        except CacheMissError as e:
            if not self.origin:
                raise
            raise CacheMissError(
                f"{e}\nThe call's manifest entry (add it to a manifest that warms the cache, "
                f"or record it with QUACK_CACHE_RECORD=FILE): {self.origin}"
            ) from e

    def run(self, **values) -> None:
        """Launch on a call's values, by the kernel's parameter names (absent
        ones None; ``Launch.arguments``); nothing launches for zero rows."""
        args, no_rows = self.launch.arguments(values)
        if not no_rows:
            self.load()(*args)

    def arg(self, name: str):
        """The compile argument named ``name`` in the compile function's signature."""
        names = _PARAMETERS.get(self.compile)
        if names is None:
            names = _PARAMETERS[self.compile] = tuple(inspect.signature(self.compile).parameters)
        return self.args[names.index(name)]

    def describe(self) -> str:
        return f"{self.compile.__name__}{self.args!r}"


_PARAMETERS: dict[Callable, tuple[str, ...]] = {}  # compile function -> its parameter names


@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernels one signature needs, by role; built by the signature's ``kernels()``."""

    signature: Any
    kernels: tuple[tuple[str, Kernel], ...]

    def kernel_of(self, role: str) -> Kernel:
        for name, kernel in self.kernels:
            if name == role:
                return kernel
        raise KeyError(f"{type(self.signature).OP} plan has no {role!r} kernel")

    def kernel(self, role: str):
        """The launchable handle of the kernel for ``role``."""
        return self.kernel_of(role).load()

    def run(self, role: str, **values) -> None:
        """Launch the kernel for ``role`` on a call's values (``Kernel.run``)."""
        self.kernel_of(role).run(**values)

    def warm(self) -> None:
        """Load (in compile-only mode: export) every kernel of the plan, for
        a compile target its op accepts."""
        check_arch(type(self.signature))
        for _, kernel in self.kernels:
            kernel.load()


class Signature:
    """Base of the op signatures: frozen dataclasses with ``OP`` (the manifest
    name, which is also the op's module and kernel family), ``ARCHS`` (the
    compile targets its kernels build for) and ``kernels()``, the (role,
    Kernel) pairs of its plan (``signature`` refuses a class without one)."""

    OP: ClassVar[str]
    ARCHS: ClassVar[tuple[str, ...]] = CLUSTER_ARCHS

    def entry(self) -> dict:
        """The manifest entry: ``{"op": ..., field: value, ...}``."""
        return {"op": self.OP, **dataclasses.asdict(self)}

    def rebuild(self) -> "Signature":
        """The signature the op itself makes of a call with these fields: fake
        tensors (compile-only mode) built from the fields (``fake_tensor``)
        through the op's own checks and signature construction, which raise
        TypeError or ValueError where the op refuses the call.  A manifest
        entry must rebuild into itself (``from_entry``).  This default, for
        an op that defines none, takes the fields as they are."""
        return self


def signature(cls):
    """Class decorator: a frozen dataclass registered under its ``OP``."""
    if "kernels" not in vars(cls):
        raise TypeError(f"signature {cls.__name__} defines no kernels()")
    cls = dataclasses.dataclass(frozen=True)(cls)
    if cls.OP in _SIGNATURES:
        raise ValueError(f"two signatures for op {cls.OP!r}")
    _SIGNATURES[cls.OP] = cls
    return cls


def plan_for(sig: Signature) -> Plan:
    """The plan of ``sig``: built on first use in this process, then looked up.
    Every call's signature is also recorded while ``QUACK_CACHE_RECORD`` is set
    (once per file and signature)."""
    plan = _PLANS.get(sig)
    if plan is None:
        with _LOCK:
            plan = _PLANS.get(sig)
            if plan is None:
                check_arch(type(sig))
                origin = entry_line(sig)
                kernels = tuple((role, dataclasses.replace(k, origin=origin)) for role, k in sig.kernels())
                plan = _PLANS[sig] = Plan(sig, kernels)
    if recording.RECORD_ENV in os.environ:
        recording.record(sig, entry_line)
    return plan


def kernel_for(sig: Signature, role: str) -> Kernel:
    """``sig``'s kernel for ``role`` without planning the call (neither kept
    nor recorded): for a registered backward op, whose call's forward was
    planned already.  Like a plan's, it names ``sig``'s manifest line on a
    strict-mode miss."""
    check_arch(type(sig))
    for name, kernel in sig.kernels():
        if name == role:
            return dataclasses.replace(kernel, origin=entry_line(sig))
    raise KeyError(f"{sig.OP} signature has no {role!r} kernel")


def entry_line(sig: Signature) -> str:
    """A signature as one manifest line (keys sorted: the same call, the same line)."""
    return json.dumps(sig.entry(), sort_keys=True)


def check_arch(cls: type) -> None:
    """Refuse, before any DSL code, a compile target (QUACK_ARCH, else the
    visible GPU's arch) that the kernels of op signature ``cls`` cannot be
    built for."""
    from quack.cache import current_arch

    arch = current_arch()
    if arch not in cls.ARCHS:
        raise ValueError(
            f"{cls.OP} kernels cannot be compiled for {arch} (the compile target: QUACK_ARCH, else the "
            f"visible GPU's arch); they build for {', '.join(cls.ARCHS)}"
        )


def from_entry(entry: dict) -> Signature:
    """The signature a manifest entry names; ValueError (or TypeError) for an
    unknown op, fields that are not exactly the op's, or values no call of
    the op has (``Signature.rebuild``), naming the field where one is to
    blame.  Op ``X``'s signature is defined in ``quack/families/X/``, imported here
    on demand (a family's build action holds only its own module)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("op"), str):
        raise ValueError(f"a manifest entry must be an object with an 'op' name, got {entry!r}")
    cls = signature_class(entry["op"])
    given = set(entry) - {"op"}
    wanted = {f.name for f in dataclasses.fields(cls)}
    if given != wanted:
        missing, extra = sorted(wanted - given), sorted(given - wanted)
        raise ValueError(f"{entry['op']} entry fields differ from the signature: missing {missing}, unknown {extra}")
    for field in dataclasses.fields(cls):
        _check_type(entry["op"], field, entry[field.name])
    sig = cls(**{k: v for k, v in entry.items() if k != "op"})
    from quack.compile_only import compile_only_mode

    with compile_only_mode():
        rebuilt = sig.rebuild()
    for field in dataclasses.fields(cls):
        given, made = getattr(sig, field.name), getattr(rebuilt, field.name)
        if given != made:
            raise ValueError(
                f"{sig.OP} entry field {field.name!r} is {json.dumps(given)}, which no call has: "
                f"a call with the entry's other fields has {json.dumps(made)}"
            )
    return sig


@contextlib.contextmanager
def blame(sig: Signature, field: str) -> Iterator[None]:
    """For ``rebuild``: name ``field`` (and its value) in a TypeError or
    ValueError (NotImplementedError: a ValueError here) the op raises about
    the part of the call built from it."""
    try:
        yield
    except (TypeError, ValueError, NotImplementedError) as e:
        kind = TypeError if isinstance(e, TypeError) else ValueError
        raise kind(f"{sig.OP} entry field {field!r} = {json.dumps(getattr(sig, field))}: {e}") from None


def torch_dtype(sig: Signature, field: str):
    """The torch dtype a signature field names ("bfloat16": torch.bfloat16)."""
    import torch

    name = getattr(sig, field)
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{sig.OP} entry field {field!r} must name a torch dtype, got {name!r}")
    return dtype


def fake_tensor(sig: Signature, field: str, shape: tuple[int, ...], offset: int = 0):
    """For ``rebuild``: a contiguous CUDA tensor (fake, in compile-only mode)
    of ``shape`` and the dtype signature field ``field`` names, starting
    ``offset`` elements into its storage; None where the field is None."""
    import torch

    if getattr(sig, field) is None:
        return None
    dtype = torch_dtype(sig, field)
    if min(shape) < 0 or math.prod(shape) >= 2**48:
        raise ValueError(f"no tensor has shape {shape}")
    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    storage = torch.empty(math.prod(shape) + offset, device="cuda", dtype=dtype)
    return storage.as_strided(shape, strides, offset)


def fake_rows_input(sig: Signature, validate: Callable[[Any], None]):
    """For a row-wise op's ``rebuild``: its rows input, one row of ``sig.n``
    elements of the dtype field ``dtype``, after ``validate(x)`` accepted the
    dtype (on one element) and N (blamed on those fields); it starts ``sig.vec``
    elements into its storage when that is below the full vector width, so
    its alignment gives the signature's vector width."""
    from quack.calls import torch_interop as ti

    one = fake_tensor(sig, "dtype", (1, 1))  # (a dtype field no torch dtype has raises here, as itself)
    with blame(sig, "dtype"):
        validate(one)
    with blame(sig, "n"):
        validate(fake_tensor(sig, "dtype", (1, sig.n)))
    offset = sig.vec if 0 < sig.vec < ti.full_width(sig.n, sig.dtype) else 0
    return fake_tensor(sig, "dtype", (1, sig.n), offset)


# A signature field's annotation -> the JSON values it takes (1.0 for an
# int, or 1 for a bool, would compare equal and hash to another object key).
_FIELD_TYPES = {"str": (str,), "int": (int,), "bool": (bool,), "Optional[str]": (str, type(None))}


def _check_type(op: str, field, value) -> None:
    allowed = _FIELD_TYPES[field.type]
    if type(value) not in allowed:
        raise ValueError(f"{op} entry field {field.name!r} must be {field.type}, got {value!r}")


def signature_class(op: str) -> type:
    """The signature class of op ``op`` (importing its family, ``quack/families/<op>/``)."""
    if op not in _SIGNATURES and op.isidentifier():
        try:
            importlib.import_module(f"quack.families.{op}")
        except ModuleNotFoundError:
            pass
    cls = _SIGNATURES.get(op)
    if cls is None:
        raise ValueError(f"unknown op {op!r}")
    return cls


def clear() -> None:
    """Forget every plan, and the fast path's closures built from them
    (tests that change the cache's knobs)."""
    from quack.calls import fastpath

    with _LOCK:
        _PLANS.clear()
    fastpath.clear()
