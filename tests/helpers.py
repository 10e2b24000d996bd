"""Helpers for multi-process tests: spawn real workers on loopback, collect their results in the parent.

Workers are started with the ``spawn`` method, find each other through a coordinator on a free
127.0.0.1 port, and send back either their return value or the formatted exception. Assertions are
made by the test, in the parent process.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A free 127.0.0.1 port outside the kernel's ephemeral range (as tfcs-run picks one): rank 0 binds
    it seconds after this returns, and meanwhile the servers and outgoing connections of the test
    running beside this one (pytest -n 2) take kernel-chosen ports, which could include this one."""
    from tf_commstrategy.launcher.run import _free_port
    return _free_port("127.0.0.1")


def wait_until(predicate, timeout: float = 30.0, poll: float = 0.05) -> bool:
    """Poll ``predicate()`` until it is true; False when it has not become true within ``timeout`` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll)
    return bool(predicate())


def wait_for_port(port: int, listening: bool, timeout: float = 30.0) -> bool:
    """Poll until 127.0.0.1:``port`` accepts connections (``listening``) or refuses them (not
    ``listening``); False when that has not happened within ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            s.settimeout(1.0)
            if (s.connect_ex(("127.0.0.1", port)) == 0) == listening:
                return True
        time.sleep(0.05)
    return False


class WorkerFailed(AssertionError):
    pass


def kept_log_messages(level=None) -> list:
    """In a worker: a list that receives every message of the ``tf_commstrategy`` logger from now on
    (``level``: set the logger's level too, e.g. ``logging.INFO``)."""
    import logging
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    logger = logging.getLogger("tf_commstrategy")
    logger.addHandler(Keep())
    if level is not None:
        logger.setLevel(level)
    return messages


def rank_values(rank: int, dtype, n: int, seed: int):
    """Rank ``rank``'s all-reduce input of ``n`` elements (the parent computes the expected result from
    the same numbers): small integers for integer and float16 dtypes (exact sums), else in [-1, 1)
    (shifted by 1 for float64, so products stay away from 0)."""
    import numpy as np
    rng = np.random.default_rng(seed + rank)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-50, 50, n).astype(dtype)
    if dtype == "float16":
        return rng.integers(-8, 8, n).astype(dtype)
    return (rng.random(n) * 2 - 1 + (1.0 if dtype == "float64" else 0.0)).astype(dtype)


def reduced_reference(size: int, op: str, dtype, n: int, seed: int):
    """numpy's reduction of ``rank_values`` over ``size`` ranks: float16 sums accumulated in float32,
    integer means floored."""
    import numpy as np
    xs = np.stack([rank_values(r, dtype, n, seed) for r in range(size)])
    if op == "sum":
        return xs.sum(0, dtype=np.float32 if dtype == "float16" else None).astype(dtype)
    if op == "mean":
        return (xs.sum(0) // size if np.dtype(dtype).kind in "iu" else xs.mean(0)).astype(dtype)
    return {"max": xs.max, "min": xs.min, "prod": xs.prod}[op](0).astype(dtype)


def allreduce_until_killed(y, rank: int, counter) -> tuple:
    """Rank 2 kills itself (SIGKILL) 1.5 s from now; every rank all-reduces ``y`` in place until an
    error. Returns (error class name, its peer_rank, seconds from the kill to the error, counter())."""
    import signal
    import threading
    import tf_commstrategy as tfcs
    if rank == 2:
        threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t_kill = time.time() + 1.5
    try:
        while time.time() < t_kill + 60:
            tfcs.allreduce(y, op="max", out=y)
    except tfcs.TfcsError as e:
        return type(e).__name__, getattr(e, "peer_rank", None), time.time() - t_kill, counter()
    return "no error", None, 0, counter()


def refill_and_allreduce(y, rank: int, size: int, calls: int) -> list:
    """Back-to-back in-place all-reduces of ``y``, refilled with this call's values before each, the
    ranks drifting apart now and then: a rank that returned while a peer still read its array would
    hand that peer the next call's values. Returns the calls whose result was wrong."""
    import numpy as np
    import tf_commstrategy as tfcs
    rng = np.random.default_rng(rank)
    wrong = []
    for i in range(calls):
        if rng.random() < 0.1:
            time.sleep(rng.random() * 0.002)
        y[:] = rank * 1000 + i
        tfcs.allreduce(y, out=y)
        want = sum(r * 1000 + i for r in range(size))
        if not (y == want).all():
            wrong.append((i, float(y.min()), float(y.max()), want))
    return wrong


def cross_memory_max_ranks() -> int:
    """How many sibling worker processes here may all read each other with process_vm_readv (the
    all-reduce's cross-memory reads): 0 when the call is refused outright (a seccomp filter, no such
    syscall) or by Yama's ptrace_scope 3 (or 2 without CAP_SYS_PTRACE); 2 under ptrace_scope 1 (the
    ranks of a 2-rank job name each other; bigger jobs fall back by design); else any number."""
    import numpy as np
    from tf_commstrategy.backends.host import shm_cma
    try:
        shm_cma.read_array(os.getpid(), np.ones(1).ctypes.data, np.empty(1))
    except (OSError, AttributeError):
        return 0
    scope = shm_cma.yama_scope()
    try:
        with open("/proc/self/status") as f:
            cap_eff = int(next(line.split()[1] for line in f if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        cap_eff = 0
    may_ptrace_anyone = bool(cap_eff & (1 << 19))  # CAP_SYS_PTRACE
    if scope >= 3:
        return 0
    if scope == 0 or may_ptrace_anyone:
        return 1 << 30
    return 2 if scope == 1 else 0


def leaked_shm_segments(before) -> list:
    """tf_commstrategy segments in /dev/shm that are not in ``before`` and whose creating process is
    gone: a leak. Segments of live processes (another test's, under ``pytest -n 2``) do not count."""
    from tf_commstrategy.core import shared_memory as M
    left = []
    for name in set(os.listdir(M.SHM_DIR)) - set(before):
        if not name.startswith(M.PREFIX):
            continue
        try:
            pid = int(name[len(M.PREFIX):].split("-", 1)[0])
        except ValueError:
            left.append(name)
            continue
        if not M.pid_alive(pid):
            left.append(name)
    return sorted(left)


def _entry(fn, rank, size, port, env, args, q):
    faulthandler.enable()
    faulthandler.dump_traceback_later(int(env.pop("_TFCS_TEST_DUMP_S", "600")), exit=False)
    os.environ.update(env)
    os.environ.update({"TFCS_RANK": str(rank), "TFCS_WORLD_SIZE": str(size), "TFCS_LOCAL_RANK": str(rank),
                       "TFCS_COORDINATOR": f"127.0.0.1:{port}"})
    try:
        result = fn(rank, size, *args)
        q.put((rank, True, pickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        q.put((rank, False, pickle.dumps((type(e).__name__, str(e), traceback.format_exc()))))
    finally:
        try:
            import tf_commstrategy as tfcs
            tfcs.shutdown()
        except Exception:
            pass


def run_workers(fn, size, *args, timeout=120.0, env=None, expect_failure=False):
    """Run ``fn(rank, size, *args)`` in ``size`` fresh processes. Returns the list of results by rank.

    With ``expect_failure`` returns ``{rank: ("ok", value) | ("error", (cls, msg, tb))}`` instead of raising.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    base_env = {"TFCS_TIMEOUT": "60", "TFCS_RENDEZVOUS_TIMEOUT": "60", "PYTHONFAULTHANDLER": "1",
                "_TFCS_TEST_DUMP_S": str(int(timeout) + 5)}
    base_env.update(env or {})
    procs = [ctx.Process(target=_entry, args=(fn, r, size, port, dict(base_env), args, q), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    results = {}
    end = time.monotonic() + timeout
    try:
        while len(results) < size:
            left = end - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, blob = q.get(timeout=min(left, 1.0))
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
                continue
            results[rank] = ("ok", pickle.loads(blob)) if ok else ("error", pickle.loads(blob))
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(20.0, end - time.monotonic() + 5)))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    missing = sorted(set(range(size)) - set(results))
    if expect_failure:
        for r in missing:
            results[r] = ("missing", procs[r].exitcode)
        return results
    if missing:
        raise WorkerFailed(f"ranks {missing} returned nothing within {timeout} s "
                           f"(exit codes {[procs[r].exitcode for r in missing]})")
    errors = {r: v for r, (k, v) in results.items() if k == "error"}
    if errors:
        text = "\n".join(f"--- rank {r}: {cls}: {msg}\n{tb}" for r, (cls, msg, tb) in sorted(errors.items()))
        raise WorkerFailed(f"workers failed:\n{text}")
    return [results[r][1] for r in range(size)]
