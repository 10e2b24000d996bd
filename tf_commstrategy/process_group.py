"""The process group: who we are, how to reach the others, and the backends built on top.

One ``ProcessGroup`` per job per process is the usual case (the module-level default behind
``tfcs.init``), but the class holds no global state, so tests may build several in one process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Dict, List, Optional

from . import config
from .core import grpc_util
from .core.auto import choose
from .core.backend import Backend, CollectiveWatch, factory_for, normalize_backend_name
from .config import parse_compression
from .errors import ConfigurationError, NotInitializedError
from .rendezvous import rendezvous as rdv
from .rendezvous.cluster_env import ClusterSpec, split_host_port

log = logging.getLogger("tf_commstrategy")


@dataclasses.dataclass(frozen=True)
class GroupSettings:
    """Everything that identifies a process group; ``init`` twice must give equal settings."""

    rank: int
    world_size: int
    local_rank: Optional[int]
    coordinator: Optional[str]
    backend: str
    timeout: float
    rendezvous_timeout: float
    chunk_bytes: Optional[int]  # None: chosen by the ring for its transports
    bind_host: Optional[str]
    advertise_host: Optional[str]
    transport: str = "auto"
    token: Optional[str] = dataclasses.field(repr=False, default=None)
    tls: Optional[grpc_util.TlsConfig] = dataclasses.field(repr=False, default=None)
    compression: str = "none"

    @classmethod
    def resolve(cls, spec: ClusterSpec, backend=None, timeout=None, rendezvous_timeout=None,
                chunk_bytes=None, bind_host=None, advertise_host=None, token=None, transport=None, environ=None,
                tls=None, compression=None):
        env = os.environ if environ is None else environ
        b = normalize_backend_name(backend) or normalize_backend_name(config.backend_from_env(env))
        return cls(
            rank=spec.rank, world_size=spec.world_size, local_rank=spec.local_rank,
            coordinator=spec.coordinator, backend=b,
            timeout=float(timeout) if timeout is not None else config.timeout_from_env(env),
            rendezvous_timeout=(float(rendezvous_timeout) if rendezvous_timeout is not None
                                else config.rendezvous_timeout_from_env(env)),
            chunk_bytes=int(chunk_bytes) if chunk_bytes is not None else config.chunk_bytes_from_env(env),
            bind_host=bind_host or config.bind_host_from_env(env),
            advertise_host=advertise_host or config.advertise_host_from_env(env),
            transport=config.parse_transport(transport) if transport else config.transport_from_env(env),
            token=token if token is not None else config.token_from_env(env),
            tls=tls if tls is not None else grpc_util.TlsConfig.from_env(env),
            compression=(parse_compression(compression) if compression is not None
                         else config.compression_from_env(env)),
        )


class ProcessGroup:
    """A joined job: rank, size, the coordinator store, and lazily built backends."""

    def __init__(self, settings: GroupSettings):
        if settings.timeout <= 0 or (settings.chunk_bytes is not None and settings.chunk_bytes <= 0):
            raise ConfigurationError(f"timeout={settings.timeout} and chunk_bytes={settings.chunk_bytes} "
                                     "must be positive", fix="pass positive values")
        if settings.chunk_bytes is not None and settings.chunk_bytes > config.MAX_CHUNK_BYTES:
            raise ConfigurationError(f"chunk_bytes={settings.chunk_bytes} is larger than the largest ring chunk, "
                                     f"{config.MAX_CHUNK_BYTES} bytes (one gRPC message holds 256 MiB)",
                                     rank=settings.rank,
                                     fix="set TFCS_CHUNK_BYTES (or chunk_bytes=) to 128M or less; 1-4M is usual")
        self.settings = settings
        self.rank = settings.rank
        self.size = settings.world_size
        self.timeout = settings.timeout
        self.rendezvous_timeout = settings.rendezvous_timeout
        self.chunk_bytes = settings.chunk_bytes
        self.token = settings.token
        self.transport = config.parse_transport(settings.transport)  # also when settings were built by hand
        self.tls = settings.tls
        self.compression = parse_compression(settings.compression)  # the default of the job's all-reduces
        if self.tls is not None and self.transport == "tcp":
            raise ConfigurationError("transport='tcp' sends tensors unencrypted, but TLS is configured",
                                     rank=self.rank, fix="use transport 'auto' or 'grpc' with TLS (gRPC carries "
                                                         "TLS; 'unix' stays inside the host)")
        coord_host = split_host_port(settings.coordinator)[0] if settings.coordinator else "127.0.0.1"
        self.bind_host = settings.bind_host or rdv.default_bind_host(coord_host)
        self.advertise_host = settings.advertise_host or rdv.default_advertise_host(coord_host)
        spec = ClusterSpec(settings.rank, settings.world_size, settings.local_rank, settings.coordinator, "")
        self._rdv = rdv.join(spec, self.token, self.rendezvous_timeout, settings.bind_host, tls=self.tls)
        self.store = self._rdv.store
        self.workers = self._rdv.workers
        self.local_rank = self._rdv.local_rank
        self.local_size = self._rdv.local_size
        self._backends: Dict[str, Backend] = {}
        self._close_hooks = []  # called at shutdown, before the backends close (add_close_hook)
        self._failure_hooks = []  # called with the first error that makes the group unusable
        self._failure_sources = []  # layers above with collectives of their own: their failure, or None
        self.collective_watches: List[CollectiveWatch] = []  # layers above with collectives of their own, told of the backend's (below)
        self._lock = threading.Lock()
        self._closed = False
        self.default_backend = settings.backend
        # The ring is the control and default data plane: bring it up during init, so that every rank's
        # data server is known before the first collective (a rank that never calls a collective must
        # show up as a collective timeout, not as a rendezvous wait).
        try:
            self.backend("grpc")
        except BaseException:  # a failed init leaves nothing serving: init() can be called again
            self._rdv.close()
            raise

    def backend(self, name: str) -> Backend:
        """The backend registered as ``name`` ("grpc", "nccl"), built on first use (a collective step:
        every rank must ask for the same backend at the same point)."""
        name = normalize_backend_name(name)
        if name == "auto":
            raise ConfigurationError("'auto' is a policy, not a backend", fix="use resolve_backend()")
        with self._lock:
            if self._closed:
                raise NotInitializedError("the process group was shut down", rank=self.rank,
                                          fix="call tfcs.init() again")
            b = self._backends.get(name)
            if b is None:
                b = factory_for(name)(self)
                self._backends[name] = b
                log.debug("tf_commstrategy rank %d: backend %s ready", self.rank, name)
            return b

    def built_backend(self, name: str) -> Optional[Backend]:
        """The backend ``name`` if this group has built it, else None (never builds one)."""
        return self._backends.get(name)

    def add_close_hook(self, hook) -> None:
        """Call ``hook()`` when this group shuts down (before its backends close): a layer above that
        holds resources of the group (the TF layer's compiled all-reduce) lets go of them there."""
        self._close_hooks.append(hook)

    def add_failure_hook(self, hook) -> None:
        """Call ``hook(error)`` when a backend of this group fails (its own error, or an abort another
        rank reported): a layer above with collectives of its own stops them there."""
        self._failure_hooks.append(hook)

    def add_failure_source(self, source) -> None:
        """``source()`` gives the error that made a layer above unusable (its own collectives), or None;
        ``failure`` reports it as the group's."""
        self._failure_sources.append(source)

    def add_collective_watch(self, watch) -> None:
        """A layer above with collectives of its own that do not go through the backends (the compiled
        all-reduce) learns when this rank is inside a backend collective (``watch.python_enter()`` /
        ``watch.python_leave()``), and while it waits there is asked whether a peer has been inside one
        of the layer's own collectives all along (``watch.python_problem(seq, sig)``: the error to raise,
        or None): the ranks then called different collectives, reported long before the deadline."""
        self.collective_watches.append(watch)

    def failure(self) -> Optional[BaseException]:
        """The error that made a backend of this group (or a layer's collectives) unusable, or None."""
        for b in list(self._backends.values()):
            error = b.failure()
            if error is not None:
                return error
        return self.layer_failure()

    def layer_failure(self) -> Optional[BaseException]:
        """The failure a layer above reports for its own collectives (``add_failure_source``), or None."""
        for source in list(self._failure_sources):
            error = source()
            if error is not None:
                return error
        return None

    def failed(self, error: BaseException) -> None:
        """A backend reports the error that made it unusable (from any thread)."""
        for hook in list(self._failure_hooks):
            try:
                hook(error)
            except Exception as e:  # pragma: no cover
                log.warning("tf_commstrategy rank %d: failure hook: %s", self.rank, e)

    def resolve_backend(self, name: Optional[str], buf) -> Backend:
        """Explicit name > the group's default; "auto" picks nccl for GPU buffers when it can run."""
        name = normalize_backend_name(name) or self.default_backend
        if name != "auto":
            return self.backend(name)
        return self.backend(choose(self, buf))

    def abort(self, error: BaseException) -> None:
        for b in list(self._backends.values()):
            b.abort(error)

    def shutdown(self, barrier_timeout: float = 30.0) -> None:
        """Leave the job: wait (bounded) for the others, close backends, stop the coordinator last."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for b in self._backends.values():
            b.quiesce()  # peers leaving is expected from here on: no heartbeat alarms
        # every rank of a failed job must agree to skip the barrier: the one that failed, and the ones
        # that only heard of it (an Abort received while idle)
        failed = self.failure() is not None
        clean = False
        if self.store is not None and not failed:
            try:
                self.store.barrier("shutdown", self.size, barrier_timeout)
                clean = True
            except Exception as e:  # a dead peer must not block our exit
                log.warning("tf_commstrategy rank %d: shutdown barrier incomplete: %s", self.rank, e)
        for hook in self._close_hooks:
            try:
                hook()
            except Exception as e:  # pragma: no cover
                log.warning("tf_commstrategy rank %d: at shutdown: %s", self.rank, e)
        for b in self._backends.values():
            try:
                b.close()
            except Exception as e:  # pragma: no cover
                log.warning("tf_commstrategy rank %d: closing backend %s: %s", self.rank, b.name, e)
        if clean:
            self._leave_coordinator()
        elif self.store is not None and self.rank != 0:
            # after a failure too, an init() right after this must not reach the old coordinator: wait
            # (bounded) until rank 0 has stopped it; a dead rank 0 answers at once (connection refused)
            self._leave_coordinator(count=False)
        self._rdv.close()

    def _leave_coordinator(self, wait_s: float = 10.0, count: bool = True) -> None:
        """Make sure rank 0's coordinator is gone before ``shutdown`` returns anywhere.

        Otherwise a worker that calls ``init`` again at once could still reach the old coordinator
        (same port) and publish into a store that is about to vanish. Others report that they left;
        rank 0 stops its server when all have (or after ``wait_s``); others wait, bounded, until it is gone.
        """
        try:
            if self.rank == 0:
                end = time.monotonic() + wait_s
                while self.store.add("left", 0) < self.size - 1 and time.monotonic() < end:
                    time.sleep(0.02)
            else:
                if count:
                    self.store.add("left", 1)
                self.store.get("coordinator-closed", timeout=wait_s)  # never set: returns by error
        except Exception:
            pass  # the coordinator stopped (expected) or is unreachable: either way it is gone
