"""Per-call communication options: TF's ``CommunicationOptions`` and our ``CommOptions``.

``tf.distribute.experimental.CommunicationOptions(implementation=RING)`` selects the grpc backend,
``NCCL`` the nccl backend, ``AUTO`` the strategy's default. ``CommOptions(backend=...)`` names a
backend directly and is accepted wherever TF accepts options, because it *is* a TF ``Options``.

Precedence for one call: ``CommOptions.backend`` > ``implementation`` (RING / NCCL) > the strategy's
default (``CommStrategy(backend=...)``, then its ``communication_options``) > ``TFCS_BACKEND`` >
"auto". ``timeout_seconds`` becomes the collective deadline (0, TensorFlow's "no timeout", means the
job's deadline: no collective waits without one), ``bytes_per_pack`` the fusion bucket size.
``CommOptions.compression`` > the strategy's (``CommStrategy(compression=...)``) > the job's
(``tfcs.init(compression=...)``, ``TFCS_COMPRESSION``) > "none".
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from tensorflow.python.distribute import collective_util

from .. import config
from ..core.backend import normalize_backend_name
from ..config import parse_compression

Implementation = collective_util.CommunicationImplementation


class CommOptions(collective_util.Options):
    """``CommunicationOptions`` plus a backend name, a ring transport and compression.

    Args:
      backend: "grpc" | "nccl" | "auto" | None (None: decided by ``implementation`` / the strategy).
      bytes_per_pack: fusion bucket size in bytes; 0 fuses each batch into one call per dtype.
      timeout_seconds: the collective deadline for calls made with these options.
      implementation: TF's ``CommunicationImplementation`` (RING -> grpc, NCCL -> nccl).
      transport: data path under the ring ("auto" | "shm" | "unix" | "tcp" | "grpc"). It is fixed
        when the job starts: given to ``CommStrategy(communication_options=...)`` it selects it;
        on a single call it must equal the job's (else ConfigurationError).
      compression: "none" | "fp16" | "bf16" | None (None: the strategy's, else the job's): float32 /
        float64 gradients travel as float16 / bfloat16, half the bytes, rounded at every ring step
        (``core.compression``); the compiled one-host all-reduce is not used for compressed calls.

    Raises:
      ConfigurationError: ``backend`` is not a known backend name, ``transport`` a known transport, or
        ``compression`` a known compression.
    """

    def __init__(self, backend: Optional[str] = None, bytes_per_pack: int = 0,
                 timeout_seconds: Optional[float] = None, implementation=Implementation.AUTO,
                 transport: Optional[str] = None, compression: Optional[str] = None):
        super().__init__(bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds,
                         implementation=implementation)
        self.backend = normalize_backend_name(backend)
        self.transport = None if transport is None else config.parse_transport(transport)
        self.compression = None if compression is None else parse_compression(compression)

    def merge(self, options):
        """These options overridden by the values ``options`` sets (TF's ``Options.merge``, plus backend).

        Args:
          options: a ``CommunicationOptions``, a ``CommOptions`` or None.

        Returns:
          A new ``CommOptions``; ``self`` is not changed.
        """
        merged = super().merge(options)
        if not isinstance(merged, CommOptions):  # pragma: no cover - super deep-copies self
            merged = CommOptions(self.backend, merged.bytes_per_pack, merged.timeout_seconds,
                                 merged.implementation)
        if isinstance(options, CommOptions):
            if options.backend is not None:
                merged.backend = options.backend
            if options.transport is not None:
                merged.transport = options.transport
            if options.compression is not None:
                merged.compression = options.compression
        return merged

    def __str__(self):
        return (f"CommOptions(backend={self.backend}, bytes_per_pack={self.bytes_per_pack}, "
                f"timeout_seconds={self.timeout_seconds}, implementation={self.implementation}, "
                f"compression={self.compression})")


def with_compression(options, compression: str) -> "CommOptions":
    """A copy of ``options`` (None, TF's ``CommunicationOptions`` or a ``CommOptions``) as a ``CommOptions``
    whose compression is ``compression`` (``CommStrategy(compression=...)`` beats its options' own)."""
    out = CommOptions(compression=compression)
    return out.merge(None) if options is None else _as_comm_options(options).merge(out)


def _as_comm_options(options) -> "CommOptions":
    if isinstance(options, CommOptions):
        return copy.deepcopy(options)
    return CommOptions(bytes_per_pack=options.bytes_per_pack, timeout_seconds=options.timeout_seconds,
                       implementation=options.implementation)


def compression_of(options) -> Optional[str]:
    """The compression a merged options object asks for, None when it leaves it to the job's.

    Args:
      options: a ``CommOptions``, a TF ``CommunicationOptions``, or None.
    """
    return getattr(options, "compression", None)


def timeout_of(options) -> Optional[float]:
    """The deadline a merged options object sets for one call, None for the job's (``TFCS_TIMEOUT``).

    TensorFlow reads ``timeout_seconds=0`` as "no timeout"; here no collective waits without a
    deadline, so 0 (like None) means the job's deadline. A negative value is refused when the call
    is made (``ConfigurationError``).

    Args:
      options: a ``CommOptions``, a TF ``CommunicationOptions``, or None.

    Returns:
      Seconds, or None.
    """
    t = getattr(options, "timeout_seconds", None)
    return None if t is None or t == 0 else t


def backend_of(options) -> Optional[str]:
    """The backend an options object asks for, or None when it leaves the choice to the strategy.

    Args:
      options: a ``CommOptions``, a TF ``CommunicationOptions``, or None.

    Returns:
      ``CommOptions.backend`` when set, else "grpc" for RING, "nccl" for NCCL, None for AUTO / None.
    """
    if options is None:
        return None
    b = getattr(options, "backend", None)
    if b:
        return b
    impl = getattr(options, "implementation", Implementation.AUTO)
    if impl == Implementation.RING:
        return "grpc"
    if impl == Implementation.NCCL:
        return "nccl"
    return None


def choose_backend(per_call, strategy_backend: Optional[str], strategy_options) -> Optional[str]:
    """Backend for one call: per-call options > strategy's backend > strategy's options > None
    (None: the process group's default, i.e. ``TFCS_BACKEND`` or "auto").

    Args:
      per_call: the options passed to this call, or None.
      strategy_backend: ``CommStrategy(backend=...)``, or None.
      strategy_options: ``CommStrategy(communication_options=...)``, or None.

    Returns:
      A backend name, or None for the process group's default.
    """
    return backend_of(per_call) or strategy_backend or backend_of(strategy_options)


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend one call asked for, and whether its own options named it.

    nccl moves GPU tensors only. As in TF's ``MultiWorkerMirroredStrategy`` with
    ``implementation=NCCL``, nccl chosen as a *default* (``CommStrategy(backend="nccl")``, the
    strategy's options, ``TFCS_BACKEND``) leaves host tensors to the ring: TF itself reduces CPU
    tensors through the strategy (the partial-batch counts of a finite dataset, say). Named by the
    call's own options, nccl on host tensors is refused with the fix.

    Attributes:
      name: the backend name, or None for the process group's default.
      explicit: named by this call's options.
    """
    name: Optional[str]
    explicit: bool

    def for_tensors(self, tensors, group_default: str) -> Optional[str]:
        """The backend for these tensors: the choice, or "grpc" for host tensors under a default nccl.

        Args:
          tensors: the call's tensors.
          group_default: the process group's default backend.

        Returns:
          A backend name, or None for the process group's default.
        """
        from .device_path import on_gpu
        if not self.explicit and (self.name or group_default) == "nccl" and not all(on_gpu(t) for t in tensors):
            return "grpc"
        return self.name


def merge(default: Optional[collective_util.Options], per_call) -> collective_util.Options:
    """Timeout and pack size: per-call values override the strategy's (TF's ``Options.merge``).

    Args:
      default: the strategy's options, or None.
      per_call: this call's options, or None.

    Returns:
      The options in force for the call (a new object).
    """
    base = copy.deepcopy(default) if default is not None else collective_util.Options()
    return base.merge(per_call) if per_call is not None else base
