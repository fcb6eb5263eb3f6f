"""How many clusters of a kernel the GPU runs at once: the size of a persistent grid.

A cluster's CTAs must share one GPC, so SMs left over in a GPC that cannot
hold a whole cluster stay idle: on the H200, clusters of 16 one-per-SM CTAs
fit 7 at once (not 132 // 16 = 8), clusters of 8 two-per-SM CTAs 30 (not 33).
A persistent grid sized by the SM count alone then runs its last clusters in
a second wave, after the first has finished all of its tiles: the norm
backward at N = 256K took 1.7x as long with 8 clusters as with 7.

The driver answers the question (``cuOccupancyMaxActiveClusters``) for a
function and a launch configuration.  Rather than reach into a compiled CuTe
object for its function, we ask about an empty probe kernel whose dynamic
shared memory admits exactly the caller's CTAs per SM: the callers fix that
number themselves (``min_blocks_per_mp`` and their shared-memory plan), so the
answer is the same.
"""

from __future__ import annotations

import functools
import warnings

import torch

from quack.calls import torch_interop as ti
from quack.compile_only import is_compile_only

# Shared memory is allocated to CTAs in units of this many bytes.
SMEM_GRANULARITY = 128
# Plain sm_90 (not sm_90a), so that later GPUs can JIT the probe too.
_PROBE_PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry quack_cluster_probe() { ret; }
"""


def _constant_while_traced(fn):
    """``torch.compiler.assume_constant_result`` without its import of
    torch._dynamo (seconds, at ``import quack.<family>``): the mark it sets,
    which Dynamo reads when it meets the function (tests/test_occupancy.py
    checks that torch's decorator sets the same)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_while_traced
def resident_clusters(device_index: int, threads: int, cluster_size: int, ctas_per_sm: int) -> int:
    """Clusters of ``cluster_size`` CTAs (``threads`` each, ``ctas_per_sm`` to
    an SM) that run at once; the SM count's estimate where no GPU is visible
    (compile-only) or for single-CTA clusters, which any SM can hold.
    Callers ask from op bodies, which torch.compile does not trace; should one
    ask while it traces, the answer is taken as a constant (Dynamo cannot
    trace the driver calls)."""
    estimate = max(1, ti.sm_count(device_index) * ctas_per_sm // cluster_size)
    if cluster_size == 1 or not _gpu_visible():
        return estimate
    answer = _answer(device_index, threads, cluster_size, ctas_per_sm)
    return estimate if answer is None else answer


def _gpu_visible() -> bool:
    """A GPU the driver can answer for: not compile-only's claimed one."""
    return not is_compile_only() and torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _answer(device_index: int, threads: int, cluster_size: int, ctas_per_sm: int) -> int | None:
    """The driver's answer, or None (warned about once) if it has none."""
    try:
        return _query(device_index, threads, cluster_size, ctas_per_sm)
    except Exception as err:  # noqa: BLE001 - any failure of the query only costs the estimate
        warnings.warn(f"quack: cluster occupancy query failed ({err}); sizing grids by the SM count", stacklevel=3)
        return None


def _query(device_index: int, threads: int, cluster_size: int, ctas_per_sm: int) -> int:
    from cuda.bindings import driver

    context, probe = _probe(device_index)
    smem_per_sm = _attribute(driver, device_index, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
    reserved = _attribute(driver, device_index, "RESERVED_SHARED_MEMORY_PER_BLOCK")
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster_size, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    # The most shared memory per CTA at which ctas_per_sm still fit on an SM
    # (so no more do), rounded down to the allocation granularity.
    smem = min(_attribute(driver, device_index, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
               smem_per_sm // ctas_per_sm - reserved)
    config.sharedMemBytes = smem // SMEM_GRANULARITY * SMEM_GRANULARITY
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster_size, 1, 1
    config.attrs = [attribute]
    config.numAttrs = 1
    _checked(driver, driver.cuCtxPushCurrent(context))
    try:
        clusters = _checked(driver, driver.cuOccupancyMaxActiveClusters(probe, config))
    finally:
        driver.cuCtxPopCurrent()
    if clusters < 1:
        raise RuntimeError(f"no cluster of {cluster_size} CTAs of {threads} threads fits")
    return clusters


@functools.lru_cache(maxsize=None)
def _probe(device_index: int):
    """(the device's primary context, the empty kernel loaded in it), once per
    device.  The context is the one torch uses; it is retained for good, so
    the module outlives any state of torch's."""
    from cuda.bindings import driver

    _checked(driver, driver.cuInit(0))
    device = _checked(driver, driver.cuDeviceGet(device_index))
    context = _checked(driver, driver.cuDevicePrimaryCtxRetain(device))
    module = None
    _checked(driver, driver.cuCtxPushCurrent(context))
    try:
        module = _checked(driver, driver.cuModuleLoadData(_PROBE_PTX))
        probe = _checked(driver, driver.cuModuleGetFunction(module, b"quack_cluster_probe"))
        attributes = driver.CUfunction_attribute
        for name, value in (
            (attributes.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
            (attributes.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
             _attribute(driver, device_index, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")),
        ):
            _checked(driver, driver.cuFuncSetAttribute(probe, name, value))
    except BaseException:
        if module is not None:
            driver.cuModuleUnload(module)
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(device)
        raise
    driver.cuCtxPopCurrent()
    return context, probe


def _attribute(driver, device_index: int, name: str) -> int:
    attribute = getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    device = _checked(driver, driver.cuDeviceGet(device_index))
    return _checked(driver, driver.cuDeviceGetAttribute(attribute, device))


def _checked(driver, result):
    """The value of a driver call's (status, value) result; RuntimeError on failure."""
    status, *values = result
    if status != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{driver.cuGetErrorString(status)[1]!r} ({status.name})")
    return values[0] if values else None
