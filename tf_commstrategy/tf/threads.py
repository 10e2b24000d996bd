"""TensorFlow's thread pools sized to this worker's share of the host's cores.

TensorFlow sizes its intra-op and inter-op pools to every core of the machine. With several workers on
one host, each one then runs as many busy threads as there are cores: the pools oversubscribe the CPU
and a step waits for descheduled shards. torchrun sets
``OMP_NUM_THREADS=1`` for the same reason; ``CommStrategy`` does the equivalent for TensorFlow.

Policy ``"auto"`` (the default): when ``local_size`` workers share this host, each gets
``max(1, cores // local_size)`` intra-op and inter-op threads, where ``cores`` counts the CPUs this
process may use (``core.cpus``: its affinity mask and a cgroup CPU quota). Nothing changes when a
worker has the host to itself, when the user already chose (``TF_NUM_INTRAOP_THREADS`` /
``TF_NUM_INTEROP_THREADS``, or ``tf.config.threading`` before the strategy was built), or with ``"off"``.

The pools can only be sized before TensorFlow's runtime starts (the first op, or listing devices). The
strategy applies the policy before it lists its devices; if something ran earlier, it logs a warning
that says how to set the sizes instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import tensorflow as tf

from ..config import tf_threads_from_env
from ..core import cpus
from ..errors import ConfigurationError

log = logging.getLogger("tf_commstrategy")

_TF_ENV = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")


@dataclass(frozen=True)
class ThreadPlan:
    """What the policy decided: ``threads`` per pool (None: leave TF's sizes) and why."""
    threads: Optional[int]
    reason: str


def plan(setting: Union[str, int, None], local_size: int, cores: int,
         environ: Optional[Mapping[str, str]] = None) -> ThreadPlan:
    """Decide the pool size (pure: no TensorFlow state is read or changed).

    Args:
      setting: "auto", "off", or a positive thread count; None reads ``TFCS_TF_THREADS`` (default "auto").
      local_size: workers on this host.
      cores: CPUs available to this process.
      environ: the variables to read (default: ``os.environ``).

    Returns:
      A ``ThreadPlan``.

    Raises:
      ConfigurationError: ``setting`` is neither "auto", "off" nor a positive integer.
    """
    env = os.environ if environ is None else environ
    if setting is None:
        raw = tf_threads_from_env(env)
        try:
            setting = parse_setting(raw)
        except ConfigurationError:
            raise ConfigurationError(f"environment variable TFCS_TF_THREADS={raw!r} is invalid",
                                     fix='unset TFCS_TF_THREADS or set it to "auto", "off" or a positive '
                                         'number of threads') from None
    else:
        setting = parse_setting(setting)
    if setting == "off":
        return ThreadPlan(None, "off (tf_threads='off' / TFCS_TF_THREADS=off)")
    if isinstance(setting, int):
        return ThreadPlan(setting, f"{setting} per pool, as asked")
    chosen = [name for name in _TF_ENV if env.get(name)]
    if chosen:
        return ThreadPlan(None, f"left to {', '.join(chosen)} (set by the user)")
    if local_size <= 1:
        return ThreadPlan(None, "one worker on this host: TensorFlow's defaults")
    per = max(1, cores // local_size)
    return ThreadPlan(per, f"{local_size} workers share {cores} cores on this host: {per} per pool")


def parse_setting(value: Union[str, int]) -> Union[str, int]:
    """"auto" | "off" | a positive int (also given as text).

    Raises:
      ConfigurationError: anything else.
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"tf_threads={value!r} is not a thread setting",
                                 fix='use "auto", "off" or a positive number of threads')
    if isinstance(value, int):
        n = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "off"):
            return text
        if text in ("0", "none", "false", "no"):
            return "off"
        try:
            n = int(text)
        except ValueError:
            raise ConfigurationError(f"tf_threads={value!r} is not a thread setting",
                                     fix='use "auto", "off" or a positive number of threads') from None
    if n <= 0:
        raise ConfigurationError(f"tf_threads={value!r} must be positive",
                                 fix='use "auto", "off" or a positive number of threads')
    return n


def configure(setting: Union[str, int, None], local_size: int, rank: int) -> ThreadPlan:
    """Apply the policy to TensorFlow's pools (see the module docstring).

    Args:
      setting: "auto" | "off" | a positive int | None (``TFCS_TF_THREADS``).
      local_size: workers on this host.
      rank: this worker's rank (for the log).

    Returns:
      The plan; ``threads`` is None when the pools were left as they were.

    Raises:
      ConfigurationError: an invalid setting.
    """
    p = plan(setting, local_size, cpus.usable_cores())
    if p.threads is None:
        log.debug("tf_commstrategy rank %d: TensorFlow thread pools %s", rank, p.reason)
        return p
    current = (tf.config.threading.get_intra_op_parallelism_threads(),
               tf.config.threading.get_inter_op_parallelism_threads())
    if any(current) and (setting is None or setting == "auto"):
        p = ThreadPlan(None, f"left as configured with tf.config.threading (intra {current[0]}, "
                             f"inter {current[1]})")
        log.debug("tf_commstrategy rank %d: TensorFlow thread pools %s", rank, p.reason)
        return p
    try:
        tf.config.threading.set_intra_op_parallelism_threads(p.threads)
        tf.config.threading.set_inter_op_parallelism_threads(p.threads)
    except RuntimeError:
        log.warning(
            "tf_commstrategy rank %d: cannot size TensorFlow's thread pools to %d (%s): TensorFlow's runtime "
            "already started (an op ran before CommStrategy() was built). Workers on this host may "
            "oversubscribe its cores; build CommStrategy() before running any op, or export "
            "TF_NUM_INTRAOP_THREADS=%d TF_NUM_INTEROP_THREADS=%d", rank, p.threads, p.reason, p.threads,
            p.threads)
        return ThreadPlan(None, "too late: TensorFlow's runtime had started")
    log.info("tf_commstrategy rank %d: TensorFlow thread pools: %s", rank, p.reason)
    return p
