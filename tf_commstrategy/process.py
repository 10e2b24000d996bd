"""The process-wide default group: ``init``, ``rank``, ``size``, ``local_rank``, ``local_size``, ``shutdown``."""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Optional

from . import backends as _backends  # noqa: F401  (registers the shipped backends)
from . import config
from .process_group import GroupSettings, ProcessGroup
from .errors import ConfigurationError, NotInitializedError
from .rendezvous.cluster_env import resolve_cluster

log = logging.getLogger("tf_commstrategy")
_lock = threading.RLock()
_group: Optional[ProcessGroup] = None
_atexit_registered = False


def init(rank: Optional[int] = None, world_size: Optional[int] = None, *, local_rank: Optional[int] = None,
         coordinator: Optional[str] = None, backend: Optional[str] = None, timeout: Optional[float] = None,
         rendezvous_timeout: Optional[float] = None, chunk_bytes: Optional[int] = None,
         bind_host: Optional[str] = None, advertise_host: Optional[str] = None,
         token: Optional[str] = None, transport: Optional[str] = None, tls_cert: Optional[str] = None,
         tls_key: Optional[str] = None, tls_ca: Optional[str] = None,
         compression: Optional[str] = None) -> ProcessGroup:
    """Join the job (a collective call: every worker calls it).

    Args:
      rank, world_size, local_rank, coordinator: override what the environment says (``TFCS_*``,
        ``TF_CONFIG``, Slurm, Open MPI, torchrun variables; see ``docs/launching.md``).
      backend: default backend, "grpc" | "nccl" | "auto" (``TFCS_BACKEND``, default "auto").
      timeout: deadline of every collective in seconds (``TFCS_TIMEOUT``, default 300).
      rendezvous_timeout: how long to wait for the coordinator and the other workers
        (``TFCS_RENDEZVOUS_TIMEOUT``, default 300).
      chunk_bytes: pipelining unit of the ring (``TFCS_CHUNK_BYTES``; default 1 MiB, or 4 MiB when every
        ring link is a raw socket and some host has more ranks than cores).
      bind_host / advertise_host: where this worker's servers listen / what peers dial
        (``TFCS_BIND_HOST`` / ``TFCS_ADVERTISE_HOST``; defaults: loopback for a loopback coordinator,
        else all interfaces and the address that routes to the coordinator).
      token: the per-job secret every RPC must carry (``TFCS_TOKEN``; tfcs-run generates one).
      transport: the ring's data path, "auto" | "shm" | "unix" | "tcp" | "grpc" (``TFCS_TRANSPORT``; "auto":
        shared memory between ranks on one host (Unix sockets where it cannot be used), raw TCP between
        hosts (gRPC with TLS, or where a TCP connection cannot be opened); "tcp": raw TCP on every link).
      tls_cert / tls_key / tls_ca: PEM files for mutual TLS on every gRPC port of the job: this worker's
        certificate and key, and the CA that signed every worker's certificate (``TFCS_TLS_CERT`` /
        ``TFCS_TLS_KEY`` / ``TFCS_TLS_CA``; all three or none). See docs/fault_tolerance.md.
      compression: how the job's float32 / float64 all-reduces travel by default, "none" | "fp16" |
        "bf16" (``TFCS_COMPRESSION``, default "none"; a call's ``compression=`` overrides it).

    Returns:
      The process group (also reachable through the module functions).

    Raises:
      ConfigurationError: bad settings (e.g. unreadable TLS files, TLS with transport "tcp"), or
        ``init`` already ran with different settings.
      RendezvousError: the other workers could not be met before ``rendezvous_timeout``.
    """
    global _group
    spec = resolve_cluster(rank, world_size, local_rank, coordinator)
    tls = None
    if tls_cert or tls_key or tls_ca:
        from .core.grpc_util import TlsConfig
        tls = TlsConfig.from_paths(tls_cert or "", tls_key or "", tls_ca or "")
    settings = GroupSettings.resolve(spec, backend, timeout, rendezvous_timeout, chunk_bytes,
                                     bind_host, advertise_host, token, transport, tls=tls,
                                     compression=compression)
    with _lock:
        if _group is not None:
            if _group.settings == settings:
                return _group
            raise ConfigurationError(
                f"init() was already called with other settings: running {_group.settings}, now asked for "
                f"{settings}", rank=_group.rank,
                fix="call init() once per process with the same settings, or tfcs.shutdown() first")
        _configure_logging()
        _group = ProcessGroup(settings)
        _register_exit_hook()
        log.info("tf_commstrategy: rank %d of %d (local %d of %d) joined via %s", _group.rank, _group.size,
                 _group.local_rank, _group.local_size, spec.source)
        return _group


def _configure_logging() -> None:
    """``TFCS_LOG_LEVEL``: the logger's level, and a stderr handler when no handler would show its records."""
    level = config.log_level_from_env()
    if level is None:
        return
    logger = logging.getLogger("tf_commstrategy")
    logger.setLevel(level)
    if not logger.hasHandlers():
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(h)


def _register_exit_hook() -> None:
    """Have ``_shutdown_at_exit`` run at interpreter exit, once per process.

    It must run before concurrent.futures joins the gRPC servers' worker threads at interpreter exit
    (threading's exit hooks run before atexit ones, newest first); plain atexit stays as a fallback.
    """
    global _atexit_registered
    if _atexit_registered:
        return
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_shutdown_at_exit)
    atexit.register(_shutdown_at_exit)
    _atexit_registered = True


def is_initialized() -> bool:
    return _group is not None


def default_group() -> ProcessGroup:
    """The group ``init`` made.

    Raises:
      NotInitializedError: ``init`` has not been called (or ``shutdown`` was).
    """
    g = _group
    if g is None:
        raise NotInitializedError("tf_commstrategy is not initialized",
                                  fix="call tf_commstrategy.init() first (CommStrategy() calls it for you)")
    return g


def rank() -> int:
    """This worker's rank in [0, size())."""
    return default_group().rank


def size() -> int:
    """Number of workers in the job."""
    return default_group().size


def local_rank() -> int:
    """This worker's index among the workers on the same host."""
    return default_group().local_rank


def local_size() -> int:
    """Number of workers on this host."""
    return default_group().local_size


def shutdown() -> None:
    """Leave the job: a bounded barrier with the others, then close every backend and server.

    Harmless when not initialized. After it, ``init`` may be called again.
    """
    global _group
    with _lock:
        g, _group = _group, None
    if g is not None:
        g.shutdown()


def _shutdown_at_exit() -> None:
    global _group
    g, _group = _group, None
    if g is not None:
        try:
            g.shutdown(barrier_timeout=10.0)
        except Exception:  # pragma: no cover - interpreter teardown
            pass
