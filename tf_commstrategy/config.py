"""Settings read from ``TFCS_*`` environment variables, at the moment objects are built (never at import).

Precedence everywhere in the package: explicit argument > per-call options > strategy default >
``TFCS_*`` environment variable > built-in default. This module covers the last two layers.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, List, Mapping, Optional, Tuple, TypeVar

from .errors import ConfigurationError

T = TypeVar("T")

#: Built-in defaults, documented in docs/usage.md.
DEFAULT_TIMEOUT_S = 300.0          # collective deadline
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0
DEFAULT_CHUNK_BYTES = 1 << 20      # ring pipelining unit over gRPC: large enough to amortise a message's cost
DEFAULT_SHM_CHUNK_BYTES = 1 << 20     # ... through shared memory (rings of 4 frames stay small in /dev/shm)
DEFAULT_SOCKET_CHUNK_BYTES = 1 << 20  # ... over raw sockets, every rank with a core of its own: short chunks
TCP_CONNECT_S = 10.0  # a raw TCP link between hosts that is not open by then (a firewall) takes gRPC instead
                                      # keep the pipeline full (sending overlaps reducing)
CROWDED_SOCKET_CHUNK_BYTES = 4 << 20  # ... when some host has more ranks than cores: fewer, longer chunks
                                      # mean fewer context switches between the ranks sharing a core
MAX_CHUNK_BYTES = 128 << 20  # a chunk and its frame header must fit one gRPC message (256 MiB)
DEFAULT_SMALL_BYTES = 0            # all-reduce by all-gather up to this many bytes x (size - 1) (TFCS_SMALL_ALLREDUCE_BYTES) ...
DEFAULT_SHM_SMALL_BYTES = 64 << 10  # ... when every ring link is shared memory: half the hops, each a wake-up
DEFAULT_BACKEND = "auto"
GONE_GRACE_S = 0.5  # a peer that fails reports why within this of its connection closing: wait for the report
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0  # a silent ring neighbour is declared lost after this long (0: off)
DEFAULT_TF_THREADS = "auto"         # TF pool sizes: cores // local workers when several share a host
DEFAULT_SHM_FUSION_BYTES = 8 << 20  # each rank's shared all-reduce buffer when the whole job is on one host
NATIVE_BUILD_TIMEOUT_S = 600.0  # the compiled all-reduce's build: far longer than it takes (~10 s), bounded
NATIVE_LOCK_WAIT_S = NATIVE_BUILD_TIMEOUT_S + 60.0  # waiting for another process's build, without a deadline
DEFAULT_SHM_CMA_BYTES = 4 << 20  # all-reduces from this size read the peers' arrays (one host)

_SIZE_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
                "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'8' -> 8, '4K' -> 4096, '64M' -> 67108864, '1GiB' -> 1073741824.

    Args:
      text: a number with an optional suffix B, K/KB/KiB, M/MB/MiB, G/GB/GiB (powers of 1024).

    Returns:
      The number of bytes.

    Raises:
      ConfigurationError: the text cannot be parsed.
    """
    s = str(text).strip().upper()
    num = s.rstrip("KMGIB")
    suffix = s[len(num):]
    if not num or suffix not in _SIZE_SUFFIX:
        raise ConfigurationError(f"cannot parse size {text!r}", fix="write e.g. 8, 4K, 256K, 4M, 1G")
    try:
        value = int(float(num) * _SIZE_SUFFIX[suffix])
    except (ValueError, OverflowError):  # "1e400", "inf", "nan"
        raise ConfigurationError(f"cannot parse size {text!r}", fix="write e.g. 8, 4K, 256K, 4M, 1G") from None
    if value < 0:
        raise ConfigurationError(f"size {text!r} is negative", fix="write a size of 0 or more, e.g. 8, 4K, 4M")
    return value


def parse_bool(text: str) -> bool:
    """The one spelling of an on/off setting: 1, true, yes, on / 0, false, no, off (any case).

    Raises:
      ValueError: anything else (a typo must not silently mean "on").
    """
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected 1 or 0 (also true/false, yes/no, on/off)")


def parse_switch(text: str) -> str:
    """A setting that is "auto", "on" or "off" (on and off spelled as ``parse_bool`` accepts).

    Raises:
      ValueError: anything else.
    """
    t = str(text).strip().lower()
    if t == "auto":
        return "auto"
    try:
        return "on" if parse_bool(t) else "off"
    except ValueError:
        raise ValueError("expected auto, 1 or 0") from None


def parse_seconds(text: str) -> float:
    """A positive, finite number of seconds.

    Raises:
      ValueError: not a number, or not > 0.
    """
    v = float(text)
    if not 0 < v < float("inf"):
        raise ValueError("must be a number of seconds > 0")
    return v


def parse_seconds_or_off(text: str) -> float:
    """A finite number of seconds >= 0 (0: off).

    Raises:
      ValueError: not a number, or negative.
    """
    v = float(text)
    if not 0 <= v < float("inf"):
        raise ValueError("must be a number of seconds >= 0")
    return v


def parse_count(text: str) -> int:
    """A whole number >= 0.

    Raises:
      ValueError: anything else.
    """
    try:
        v = int(str(text).strip())
    except ValueError:
        raise ValueError("not an integer") from None
    if v < 0:
        raise ValueError("must be >= 0")
    return v


def parse_text(text: str) -> str:
    """Text as given, surrounding blanks removed."""
    return str(text).strip()


def parse_name(text: str) -> str:
    """A lower-cased name (validated by its user)."""
    return str(text).strip().lower()


def env_value(name: str, parse: Callable[[str], T], default: T,
              environ: Optional[Mapping[str, str]] = None) -> T:
    """Read ``name`` from the environment and parse it, with an error that names the variable.

    Args:
      name: the variable.
      parse: turns its text into a value; raises ``ValueError`` for invalid text.
      default: the value when the variable is unset or empty.
      environ: the variables to read (default: ``os.environ``).

    Returns:
      The parsed value, or ``default``.

    Raises:
      ConfigurationError: the value is invalid (the message names the variable).
    """
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except (ValueError, ConfigurationError) as e:
        raise ConfigurationError(f"environment variable {name}={raw!r} is invalid ({e})",
                                 fix=f"unset {name} or give it a valid value") from None


def timeout_from_env(environ=None) -> float:
    """``TFCS_TIMEOUT``: the collective deadline in seconds (default 300; must be > 0).

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      Seconds.

    Raises:
      ConfigurationError: the value is invalid.
    """
    return env_value("TFCS_TIMEOUT", parse_seconds, DEFAULT_TIMEOUT_S, environ)


def call_timeout(timeout, default: float, rank: Optional[int] = None) -> float:
    """The deadline of one call: ``timeout`` when given, else ``default`` (the group's).

    Args:
      timeout: seconds for this call, or None.
      default: the group's deadline.
      rank: this worker's rank, for the message.

    Returns:
      Seconds, > 0.

    Raises:
      ConfigurationError: ``timeout`` is not a number > 0 (checked before the collective starts, so
        the process group stays usable).
    """
    if timeout is None:
        return default
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigurationError(f"timeout={timeout!r} for one collective", rank=rank,
                                 fix="pass a number of seconds > 0, or None for the job's deadline (TFCS_TIMEOUT); "
                                     "no collective waits without a deadline")
    return value


def rendezvous_timeout_from_env(environ=None) -> float:
    """``TFCS_RENDEZVOUS_TIMEOUT``: seconds to wait for the coordinator and every worker (default 300).

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      Seconds.

    Raises:
      ConfigurationError: the value is invalid.
    """
    return env_value("TFCS_RENDEZVOUS_TIMEOUT", parse_seconds, DEFAULT_RENDEZVOUS_TIMEOUT_S, environ)


def chunk_bytes_from_env(environ=None) -> Optional[int]:
    """``TFCS_CHUNK_BYTES``: the ring's pipelining unit (a size such as "4M").

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      The size in bytes, or None when unset: the ring then picks a size that suits its transports.

    Raises:
      ConfigurationError: the value is invalid.
    """
    return env_value("TFCS_CHUNK_BYTES", parse_size, None, environ)


def small_bytes_from_env(environ=None) -> Optional[int]:
    """``TFCS_SMALL_ALLREDUCE_BYTES``: all-reduce by one all-gather pass while ``nbytes x (size - 1)``
    is at most this (0: never). Unset: None, and the ring decides (64 KiB when every ring link is
    shared memory, where halving the hops pays; else 0).

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      Bytes, or None when unset.

    Raises:
      ConfigurationError: the value is invalid.
    """
    return env_value("TFCS_SMALL_ALLREDUCE_BYTES", parse_size, None, environ)


def heartbeat_timeout_from_env(environ=None) -> float:
    """``TFCS_HEARTBEAT_TIMEOUT`` seconds (0 turns peer heartbeats off).

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      Seconds (0: off).

    Raises:
      ConfigurationError: the value is invalid.
    """
    return env_value("TFCS_HEARTBEAT_TIMEOUT", parse_seconds_or_off, DEFAULT_HEARTBEAT_TIMEOUT_S, environ)


def hierarchical_from_env(environ=None) -> bool:
    """``TFCS_HIERARCHICAL``: 1 (default) uses the hierarchical all-reduce when ranks span several
    hosts with several ranks on some; 0 keeps the flat ring."""
    return env_value("TFCS_HIERARCHICAL", parse_bool, True, environ)


def shm_cma_bytes_from_env(environ=None) -> int:
    """``TFCS_SHM_CMA``: with every rank on one host, the smallest all-reduce (bytes) of private arrays that
    reads the peers' arrays by cross-memory attach (``process_vm_readv``) instead of taking the ring
    (default 4 MiB; 0 turns it off; values under 64 KiB count as 64 KiB, where the handshake of the
    direct all-reduce starts). Used only where every rank could read every peer at setup.

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      Bytes (0: off).

    Raises:
      ConfigurationError: the value is invalid.
    """
    return env_value("TFCS_SHM_CMA", parse_size, DEFAULT_SHM_CMA_BYTES, environ)


def shm_buffers_bytes_from_env(environ=None) -> int:
    """``TFCS_SHM_FUSION_BYTES``: size of each rank's shared-memory all-reduce buffer when every rank of
    the job shares one host's memory (default 8 MiB; 0 turns the shared-buffer all-reduce off and keeps
    the ring). Larger all-reduces go through it in pieces of this size.

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      Bytes (0: off).

    Raises:
      ConfigurationError: the value is invalid.
    """
    return env_value("TFCS_SHM_FUSION_BYTES", parse_size, DEFAULT_SHM_FUSION_BYTES, environ)


def tf_threads_from_env(environ=None) -> str:
    """``TFCS_TF_THREADS``: how ``CommStrategy`` sizes TensorFlow's intra-/inter-op pools: "auto"
    (default: each of the host's workers gets its share of the cores), "off", or a number per pool.

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      The text, lower-cased (validated by the TF layer, which applies it).
    """
    return env_value("TFCS_TF_THREADS", parse_name, DEFAULT_TF_THREADS, environ)


def parse_heap_setting(value) -> str:
    """A heap setting for ``CommStrategy(heap=...)``: "auto" | "off" (also True / False and the usual
    spellings of on and off).

    Raises:
      ConfigurationError: anything else.
    """
    if value is True:
        return "auto"
    if value is False:
        return "off"
    text = str(value).strip().lower()
    if text == "none":
        return "off"
    try:
        return "off" if parse_switch(text) == "off" else "auto"
    except ValueError:
        raise ConfigurationError(f"heap={value!r} is not a heap setting", fix='use "auto" or "off"') from None


def heap_from_env(environ=None) -> str:
    """``TFCS_HEAP``: whether ``CommStrategy`` keeps glibc's freed memory for the next step ("auto", the
    default: raise the mmap and trim thresholds; "off": glibc's own adaptive thresholds).

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      "auto" or "off".

    Raises:
      ConfigurationError: the value is invalid (the message names the variable).
    """
    return env_value("TFCS_HEAP", parse_heap_setting, "auto", environ)


#: The ring's data paths a job can ask for (docs/backends.md).
TRANSPORTS = ("auto", "shm", "unix", "tcp", "grpc")


def parse_transport(name: Optional[str]) -> str:
    """The canonical name of a requested ring transport (None or empty: "auto").

    Args:
      name: "auto", "shm", "unix", "tcp" or "grpc", in any case, surrounding blanks ignored.

    Raises:
      ConfigurationError: an unknown name.
    """
    n = (name or "auto").strip().lower()
    if n not in TRANSPORTS:
        raise ConfigurationError(f"unknown transport {name!r}", fix="use auto, shm, unix, tcp or grpc")
    return n


def transport_from_env(environ=None) -> str:
    """``TFCS_TRANSPORT``: the ring's data path (default "auto")."""
    return env_value("TFCS_TRANSPORT", parse_transport, "auto", environ)


#: Compression names, as ``CommStrategy(compression=...)``, ``CommOptions`` and ``TFCS_COMPRESSION`` take them.
COMPRESSIONS = ("none", "fp16", "bf16")

_COMPRESSION_ALIASES = {"": "none", "off": "none", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


def parse_compression(name: Optional[str]) -> str:
    """The canonical name of a compression setting (None or empty: "none").

    Args:
      name: "none", "fp16" or "bf16" (also "float16", "half", "bfloat16", "off"), any case.

    Raises:
      ConfigurationError: an unknown name.
    """
    n = (name or "none").strip().lower()
    n = _COMPRESSION_ALIASES.get(n, n)
    if n not in COMPRESSIONS:
        raise ConfigurationError(f"unknown compression {name!r}", fix="use none, fp16 or bf16")
    return n


def compression_from_env(environ=None) -> str:
    """``TFCS_COMPRESSION``: how float32 / float64 sums and means travel, "none" (default), "fp16" or
    "bf16" (``core.compression``)."""
    return env_value("TFCS_COMPRESSION", parse_compression, "none", environ)


def native_from_env(environ=None) -> str:
    """``TFCS_NATIVE``: the compiled all-reduce op of the strategy when every rank shares one host's
    memory: "auto" (default: used when it builds), "on" (``1``: it must, else ConfigurationError), "off"
    (``0``: the ``tf.numpy_function`` path)."""
    return env_value("TFCS_NATIVE", parse_switch, "auto", environ)

def backend_from_env(environ=None) -> str:
    """``TFCS_BACKEND``: the default backend name, lower-cased (default "auto").

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      The name.
    """
    return env_value("TFCS_BACKEND", parse_name, DEFAULT_BACKEND, environ)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def log_level_from_env(environ=None) -> Optional[str]:
    """``TFCS_LOG_LEVEL``: DEBUG, INFO, WARNING or ERROR; when set, ``init()`` gives the ``tf_commstrategy``
    logger that level and, if nothing handles its records yet, a handler on stderr (``tfcs-run --verbose``
    sets INFO). Unset: logging is left as the program configured it."""
    def parse(text: str) -> str:
        level = text.strip().upper()
        if level not in LOG_LEVELS:
            raise ValueError(f"one of {', '.join(LOG_LEVELS)}")
        return level
    return env_value("TFCS_LOG_LEVEL", parse, None, environ)


def nccl_check_from_env(environ=None) -> bool:
    """``TFCS_NCCL_CHECK``: 1 (default) checks, with every nccl collective, that all ranks make the
    same call (one 16-byte all-reduce queued just ahead of it); 0 skips the check (a mismatched call
    then hangs until the deadline or mixes data up, as in plain NCCL)."""
    return env_value("TFCS_NCCL_CHECK", parse_bool, True, environ)


# -- who and where: set by tfcs-run or by the user (engines' own variables are read in rendezvous/) ----
def tfcs_cluster_from_env(environ=None) -> Optional[Tuple[int, int, Optional[int]]]:
    """``TFCS_RANK``, ``TFCS_WORLD_SIZE`` (both, or this source is not used) and ``TFCS_LOCAL_RANK``.

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      ``(rank, world_size, local_rank or None)``, or None when rank and size are not both set.

    Raises:
      ConfigurationError: a value is not a whole number >= 0 (the message names the variable).
    """
    env = os.environ if environ is None else environ
    if "TFCS_RANK" not in env or "TFCS_WORLD_SIZE" not in env:
        return None
    return (env_value("TFCS_RANK", parse_count, 0, env), env_value("TFCS_WORLD_SIZE", parse_count, 0, env),
            env_value("TFCS_LOCAL_RANK", parse_count, None, env))


def coordinator_from_env(environ=None) -> Optional[str]:
    """``TFCS_COORDINATOR``: rank 0's coordinator, ``host:port`` (None when unset)."""
    return env_value("TFCS_COORDINATOR", parse_text, None, environ)


def coordinator_port_from_env(environ=None) -> Optional[int]:
    """``TFCS_COORDINATOR_PORT``: the coordinator's port under Slurm (None when unset)."""
    return env_value("TFCS_COORDINATOR_PORT", parse_count, None, environ)


def bind_host_from_env(environ=None) -> Optional[str]:
    """``TFCS_BIND_HOST``: where this worker's servers listen (None when unset)."""
    return env_value("TFCS_BIND_HOST", parse_text, None, environ)


def advertise_host_from_env(environ=None) -> Optional[str]:
    """``TFCS_ADVERTISE_HOST``: the address peers dial to reach this worker (None when unset)."""
    return env_value("TFCS_ADVERTISE_HOST", parse_text, None, environ)


def token_from_env(environ=None) -> Optional[str]:
    """``TFCS_TOKEN``: the job's shared secret (None when unset: no check)."""
    return env_value("TFCS_TOKEN", parse_text, None, environ)


def tls_files_from_env(environ=None) -> Tuple[str, str, str, Optional[str]]:
    """``TFCS_TLS_CERT``, ``TFCS_TLS_KEY``, ``TFCS_TLS_CA`` (paths, "" when unset) and ``TFCS_TLS_SERVER_NAME``."""
    return (env_value("TFCS_TLS_CERT", parse_text, "", environ), env_value("TFCS_TLS_KEY", parse_text, "", environ),
            env_value("TFCS_TLS_CA", parse_text, "", environ),
            env_value("TFCS_TLS_SERVER_NAME", parse_text, None, environ))


def native_cache_from_env(environ=None) -> Optional[str]:
    """``TFCS_NATIVE_CACHE``: where the compiled all-reduce is cached (None: the user's cache directory)."""
    return env_value("TFCS_NATIVE_CACHE", parse_text, None, environ)


def restart_count_from_env(environ=None) -> int:
    """``TFCS_RESTART_COUNT``: how many times ``tfcs-run --max-restarts`` has restarted the job (0)."""
    return env_value("TFCS_RESTART_COUNT", parse_count, 0, environ)


def bench_ports_from_env(environ=None) -> List[int]:
    """``TFCS_BENCH_PORTS``: free ports ``tfcs-bench`` hands its workers for the peers it compares with."""
    return env_value("TFCS_BENCH_PORTS", lambda s: [parse_count(p) for p in s.split(",")], [], environ)


def bench_hosts_from_env(size: int, environ=None) -> List[str]:
    """``TFCS_BENCH_HOSTS``: each rank's address for the peers ``tfcs-bench`` compares with, comma-separated
    in rank order (a job across hosts, ``benchmarks/link_allreduce.py``); unset: 127.0.0.1 for every rank.

    Raises:
      ConfigurationError: not one address per rank.
    """
    def parse(text: str) -> List[str]:
        hosts = [h.strip() for h in text.split(",") if h.strip()]
        if len(hosts) != size:
            raise ConfigurationError(f"{len(hosts)} addresses for {size} ranks", fix="give one address per rank")
        return hosts
    return env_value("TFCS_BENCH_HOSTS", parse, ["127.0.0.1"] * size, environ)


# -- the table of every variable (docs/usage.md's table is generated from it) ------------------------
@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the settings table.

    Attributes:
      names: the variables (several when they go together).
      what: what it sets, for the docs (Markdown).
      default: the default, for the docs (Markdown).
    """

    names: Tuple[str, ...]
    what: str
    default: str


SETTINGS: Tuple[Setting, ...] = (
    Setting(("TFCS_RANK", "TFCS_WORLD_SIZE", "TFCS_LOCAL_RANK", "TFCS_COORDINATOR"),
            "who and where (set by `tfcs-run`)",
            "from TF_CONFIG / Slurm / Open MPI / torchrun variables, else a single process"),
    Setting(("TFCS_BACKEND",), "default backend: `auto`, `grpc` or `nccl`", "`auto`"),
    Setting(("TFCS_TIMEOUT",), "collective deadline, seconds", "300"),
    Setting(("TFCS_RENDEZVOUS_TIMEOUT",), "how long to wait for the coordinator and the other workers, seconds",
            "300"),
    Setting(("TFCS_TRANSPORT",),
            "data path under the ring: `auto` (shared memory between ranks on one host; raw TCP between hosts, "
            "gRPC with TLS or where TCP cannot connect), `shm`, `unix`, `tcp` (raw TCP on every link, same-host "
            "ones included), "
            "`grpc` (always possible); also `tfcs-run --transport`, `tfcs.init(transport=...)`, "
            "`CommStrategy(transport=...)`", "`auto`"),
    Setting(("TFCS_COMPRESSION",),
            "how float32 / float64 sums and means travel: `none`, `fp16` or `bf16` (half the bytes, rounded to "
            "that dtype at every ring step; docs/usage.md); also `tfcs.init(compression=...)`, "
            "`CommStrategy(compression=...)`, `CommOptions(compression=...)`, `compression=` per call", "`none`"),
    Setting(("TFCS_TF_THREADS",),
            "TensorFlow's intra-/inter-op pool size under `CommStrategy`: `auto` (each of a host's workers gets "
            "`cores // local workers` when several share it), `off` (TensorFlow's defaults), or a number; also "
            "`CommStrategy(tf_threads=...)`", "`auto`"),
    Setting(("TFCS_HEAP",),
            "whether `CommStrategy` keeps the memory a training step frees for the next step: `auto` (glibc's "
            "mmap threshold raised to 32 MiB and its trim threshold to 512 MiB with `mallopt`; left alone when "
            "`MALLOC_*_` variables, `glibc.malloc` tunables or a preloaded jemalloc/tcmalloc are set), `off` "
            "(glibc's own adaptive thresholds); also `CommStrategy(heap=...)`", "`auto`"),
    Setting(("TFCS_HEARTBEAT_TIMEOUT",),
            "seconds after which a silent ring neighbour is declared lost (`PeerLostError`); 0 turns heartbeats "
            "off", "`10`"),
    Setting(("TFCS_TLS_CERT", "TFCS_TLS_KEY", "TFCS_TLS_CA"),
            "PEM files for mutual TLS on every gRPC port ([fault tolerance and security](fault_tolerance.md#tls))",
            "unset"),
    Setting(("TFCS_TLS_SERVER_NAME",),
            "the name checked against a server's TLS certificate (with the `TFCS_TLS_*` files)", "each server's host"),
    Setting(("TFCS_CHUNK_BYTES",),
            "ring pipelining unit (at most 128M: one chunk travels in one gRPC message)",
            "1 MiB; 4 MiB when every ring link is a raw socket and some host has more ranks than cores"),
    Setting(("TFCS_SHM_FUSION_BYTES",),
            "each rank's shared all-reduce buffer when every rank of the job shares one host's memory (with 2 "
            "ranks at most 130 KiB: they use only its one-round path, for all-reduces of at most 64 KiB); 0 keeps "
            "the ring ([backends](backends.md#every-rank-on-one-host-shared-all-reduce-buffers))", "8 MiB"),
    Setting(("TFCS_SHM_CMA",),
            "every rank on one host: the smallest all-reduce of private arrays that reads the peers' arrays by "
            "cross-memory attach (`process_vm_readv`) instead of copying through shared memory; at least 64 KiB; "
            "the ranks take the largest value any sets, and 0 on any rank turns it off "
            "([backends](backends.md#every-rank-on-one-host-cross-memory-reads-of-private-arrays))", "4 MiB"),
    Setting(("TFCS_NATIVE",),
            "the strategy's host all-reduce as a compiled TensorFlow op when every rank of the job shares one "
            "host's memory (built on first use with the C++ compiler on the PATH; "
            "[backends](backends.md#every-rank-on-one-host-the-compiled-all-reduce)): `auto` uses it where it "
            "builds (where it cannot, every rank logs a WARNING with the reason and the fix), `1` requires it "
            "(`ConfigurationError` naming the reason otherwise), `0` keeps the `tf.numpy_function` path", "`auto`"),
    Setting(("TFCS_NATIVE_CACHE",),
            "where the compiled op is cached (one build per machine and TensorFlow version, ~10 s; the "
            "directory and the library must belong to this user or root and be writable by no one else); "
            "`python -m tf_commstrategy.tf.native_build` prebuilds it there, e.g. in a container image",
            "`$XDG_CACHE_HOME/tf_commstrategy`, else `~/.cache/tf_commstrategy`"),
    Setting(("TFCS_SMALL_ALLREDUCE_BYTES",),
            "all-reduce buffers up to this size (x (size-1)) by one all-gather pass instead of the two-pass ring "
            "(half the hops; 0 turns it off)", "64 KiB when every ring link is shared memory, else 0"),
    Setting(("TFCS_BIND_HOST", "TFCS_ADVERTISE_HOST"), "where servers listen / what peers dial",
            "loopback for a loopback coordinator, else all interfaces / the address routing to the coordinator"),
    Setting(("TFCS_TOKEN",), "per-job secret every RPC must carry", "generated by `tfcs-run`; unset = no check"),
    Setting(("TFCS_COORDINATOR_PORT",), "coordinator port under Slurm (before `MASTER_PORT`)",
            "`MASTER_PORT` if set, else 29400 + (37 × job id + step id) % 1000"),
    Setting(("TFCS_HIERARCHICAL",),
            "with several hosts of several ranks each, all-reduce inside each host first, then between hosts (one "
            "ring per local rank); `0` keeps one flat ring", "`1`"),
    Setting(("TFCS_NCCL_CHECK",),
            "with every nccl collective, all ranks check that they make the same call (one 16-byte all-reduce of "
            "a signature hash, queued just ahead of it), so a mismatch raises `CollectiveMismatchError` instead "
            "of hanging or mixing data up; `0` skips it (one-rank jobs never check)", "`1`"),
    Setting(("TFCS_LOG_LEVEL",), "level of the `tf_commstrategy` logger, with a stderr handler if it has none "
            "(`tfcs-run --verbose`: INFO)", "unset: as the program configured logging"),
    Setting(("TFCS_RESTART_COUNT",),
            "how many times `tfcs-run --max-restarts` has restarted the job (set by `tfcs-run`, read by your "
            "script)", "`0`"),
    Setting(("TFCS_BENCH_PORTS",), "free ports `tfcs-bench` hands its workers (set by `tfcs-bench`)", "unset"),
    Setting(("TFCS_BENCH_HOSTS",), "each rank's address for the benchmark's peers (set by "
            "`benchmarks/link_allreduce.py`)", "127.0.0.1 for every rank"),
)


def settings_table() -> str:
    """The Markdown table of ``SETTINGS`` that docs/usage.md holds (``make settings-table`` writes it there)."""
    rows = ["| variable | what it sets | default |", "|---|---|---|"]
    for st in SETTINGS:
        rows.append(f"| {', '.join(f'`{n}`' for n in st.names)} | {st.what} | {st.default} |")
    return "\n".join(rows) + "\n"

