"""Settings read from ``TFCS_*`` environment variables, at the moment objects are built (never at import).

Precedence everywhere in the package: explicit argument > per-call options > strategy default >
``TFCS_*`` environment variable > built-in default. This module covers the last two layers.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional, TypeVar

from .errors import ConfigurationError

T = TypeVar("T")

#: Built-in defaults, documented in docs/usage.md.
DEFAULT_TIMEOUT_S = 300.0          # collective deadline
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0
DEFAULT_CHUNK_BYTES = 1 << 20      # ring pipelining unit over gRPC (per-message overhead ~50-100 us)
DEFAULT_SHM_CHUNK_BYTES = 1 << 20     # ... through shared memory (rings of 4 frames stay small in /dev/shm)
DEFAULT_SOCKET_CHUNK_BYTES = 1 << 20  # ... over raw sockets, every rank with a core of its own (measured,
                                      # 2 ranks over TCP: 256 MiB 0.56-0.58 of gloo, 4 MiB chunks 0.69-0.74)
CROWDED_SOCKET_CHUNK_BYTES = 4 << 20  # ... when some host has more ranks than cores (4 ranks on 2 cores,
                                      # TCP, 64 MiB: 0.87-0.92 of gloo, 1 MiB chunks 1.01-1.02)
MAX_CHUNK_BYTES = 128 << 20  # a chunk and its frame header must fit one gRPC message (256 MiB)
DEFAULT_SMALL_BYTES = 0            # all-reduce by all-gather up to this many bytes x (size - 1) (TFCS_SMALL_ALLREDUCE_BYTES) ...
DEFAULT_SHM_SMALL_BYTES = 64 << 10  # ... when every ring link is shared memory (measured: 8 B, 4 ranks: 381 -> 220 us)
DEFAULT_BACKEND = "auto"
GONE_GRACE_S = 0.5  # a peer that fails reports why within this of its connection closing: wait for the report
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0  # a silent ring neighbour is declared lost after this long (0: off)
DEFAULT_TF_THREADS = "auto"         # TF pool sizes: cores // local workers when several share a host
DEFAULT_SHM_FUSION_BYTES = 8 << 20  # each rank's shared all-reduce buffer when the whole job is on one host
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
    return env_value("TFCS_TIMEOUT", _positive_float, DEFAULT_TIMEOUT_S, environ)


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
    return env_value("TFCS_RENDEZVOUS_TIMEOUT", _positive_float, DEFAULT_RENDEZVOUS_TIMEOUT_S, environ)


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
    def parse(s: str) -> float:
        v = float(s)
        if v < 0:
            raise ValueError("must be >= 0")
        return v
    return env_value("TFCS_HEARTBEAT_TIMEOUT", parse, DEFAULT_HEARTBEAT_TIMEOUT_S, environ)


def hierarchical_from_env(environ=None) -> bool:
    """``TFCS_HIERARCHICAL``: 1 (default) uses the hierarchical all-reduce when ranks span several
    hosts with several ranks on some; 0 keeps the flat ring."""
    return env_value("TFCS_HIERARCHICAL", lambda s: s.strip().lower() not in ("0", "false", "no", "off"), True,
                     environ)


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


def shm_fusion_bytes_from_env(environ=None) -> int:
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
    return env_value("TFCS_TF_THREADS", lambda s: s.strip().lower(), DEFAULT_TF_THREADS, environ)


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
    if text in ("auto", "on", "1", "true", "yes"):
        return "auto"
    if text in ("off", "0", "false", "no", "none"):
        return "off"
    raise ConfigurationError(f"heap={value!r} is not a heap setting", fix='use "auto" or "off"')


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

def _on_off_auto(text: str) -> str:
    t = text.strip().lower()
    if t in ("auto",):
        return "auto"
    if t in ("1", "on", "true", "yes"):
        return "on"
    if t in ("0", "off", "false", "no"):
        return "off"
    raise ValueError("expected auto, 1 or 0")


def native_from_env(environ=None) -> str:
    """``TFCS_NATIVE``: the compiled all-reduce op of the strategy when every rank shares one host's
    memory: "auto" (default: used when it builds), "on" (``1``: it must, else ConfigurationError), "off"
    (``0``: the ``tf.numpy_function`` path)."""
    return env_value("TFCS_NATIVE", _on_off_auto, "auto", environ)

def backend_from_env(environ=None) -> str:
    """``TFCS_BACKEND``: the default backend name, lower-cased (default "auto").

    Args:
      environ: the variables to read (default: ``os.environ``).

    Returns:
      The name.
    """
    return env_value("TFCS_BACKEND", lambda s: s.strip().lower(), DEFAULT_BACKEND, environ)


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise ValueError("must be > 0")
    return v


def nccl_check_from_env(environ=None) -> bool:
    """``TFCS_NCCL_CHECK``: 1 (default) checks, with every nccl collective, that all ranks make the
    same call (one 16-byte all-reduce queued just ahead of it); 0 skips the check (a mismatched call
    then hangs until the deadline or mixes data up, as in plain NCCL)."""
    return env_value("TFCS_NCCL_CHECK", lambda s: s.strip().lower() not in ("0", "false", "no", "off"), True,
                     environ)
