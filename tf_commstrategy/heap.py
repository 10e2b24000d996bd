"""glibc's heap kept for the next training step instead of handed back to the kernel after each one.

A training step allocates and frees the same tensors every time. glibc's ``malloc`` serves blocks
larger than its mmap threshold with fresh ``mmap`` calls, and gives the free space at the top of a
heap back to the kernel once it exceeds its trim threshold. It adapts both thresholds as the process
runs, but only up to twice the largest block it has freed so far: a step that frees more than that
at once returns it all to the kernel, and the next step faults every page of it back in, zeroed.
How many page faults a step then takes depends on the process's history (what it freed before), so
step times vary from run to run; with the thresholds below the heap is reused and a step takes almost
none (``benchmarks/keras_throughput.py`` reports the page faults per step).

Policy ``"auto"`` (the default): raise the mmap threshold to glibc's maximum (32 MiB: blocks up to
that size are reused from the heap) and the trim threshold to ``TRIM_BYTES`` (free space up to that
size stays mapped for the next step), with ``mallopt``. This is what ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` do when set before a process starts; preloading tcmalloc or jemalloc, a
common advice for training on CPUs, has the same effect. The price: up to ``TRIM_BYTES`` of freed
memory per heap stays in the process between steps instead of going back to the system.

Nothing changes with ``"off"``, on a C library other than glibc, or when the user already chose: the
``MALLOC_*_`` variables or ``glibc.malloc`` tunables are set, or another allocator is preloaded
(``LD_PRELOAD``). TensorFlow's ``from_generator`` datasets, and the multi-device iterator of a worker
with GPUs (built on one), set the mmap threshold back to 128 KiB when they start (TensorFlow's own
workaround for a memory growth on Python 3.11; see ``tf/input_path.py``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from .config import heap_from_env, parse_heap_setting

log = logging.getLogger("tf_commstrategy")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_BYTES = 32 << 20   # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_BYTES = 512 << 20  # free space at a heap's top kept for the next step, at most
_USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard")


@dataclass(frozen=True)
class HeapPlan:
    """What the policy decided: ``apply`` the thresholds or not, and why."""
    apply: bool
    reason: str


def glibc() -> Optional[ctypes.CDLL]:
    """This process's C library when it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (AttributeError elsewhere: musl, macOS)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def plan(setting, environ: Optional[Mapping[str, str]] = None, is_glibc: Optional[bool] = None) -> HeapPlan:
    """Decide whether to set the thresholds (pure: nothing is changed).

    Args:
      setting: "auto" | "off" | None (``TFCS_HEAP``, default "auto").
      environ: the variables to read (default: ``os.environ``).
      is_glibc: whether the C library is glibc (default: look).

    Returns:
      A ``HeapPlan``.

    Raises:
      ConfigurationError: ``setting`` (or ``TFCS_HEAP``) is neither "auto" nor "off".
    """
    env = os.environ if environ is None else environ
    setting = heap_from_env(env) if setting is None else parse_heap_setting(setting)
    if setting == "off":
        return HeapPlan(False, "off (heap='off' / TFCS_HEAP=off)")
    chosen = [name for name in _USER_VARS if env.get(name)]
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return HeapPlan(False, f"left to {', '.join(chosen)} (set by the user)")
    preload = env.get("LD_PRELOAD", "").lower()
    other = [name for name in _OTHER_ALLOCATORS if name in preload]
    if other:
        return HeapPlan(False, f"left to {other[0]} (LD_PRELOAD)")
    if not (glibc() is not None if is_glibc is None else is_glibc):
        return HeapPlan(False, "not glibc: nothing to tune")
    return HeapPlan(True, f"freed blocks kept for the next step (mmap threshold {MMAP_BYTES >> 20} MiB, "
                          f"trim threshold {TRIM_BYTES >> 20} MiB)")


def configure(setting, rank: int) -> HeapPlan:
    """Apply the policy to this process's heap (see the module docstring).

    Args:
      setting: "auto" | "off" | None (``TFCS_HEAP``).
      rank: this worker's rank (for the log).

    Returns:
      The plan; ``apply`` is False when nothing was changed.

    Raises:
      ConfigurationError: an invalid setting.
    """
    p = plan(setting)
    if not p.apply:
        log.debug("tf_commstrategy rank %d: heap thresholds %s", rank, p.reason)
        return p
    libc = glibc()
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)):
        log.warning("tf_commstrategy rank %d: glibc refused the heap thresholds (mallopt); training steps may "
                    "fault their memory in afresh. Set TFCS_HEAP=off to silence this, or export "
                    "MALLOC_MMAP_THRESHOLD_=%d MALLOC_TRIM_THRESHOLD_=%d before the workers start",
                    rank, MMAP_BYTES, TRIM_BYTES)
        return HeapPlan(False, "glibc refused mallopt")
    log.info("tf_commstrategy rank %d: heap: %s", rank, p.reason)
    return p
