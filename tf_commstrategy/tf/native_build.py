"""Build and load the compiled all-reduce op (``native/shm_allreduce.cc``) on first use.

The op is compiled once per machine and TensorFlow version with the C++ compiler found on the PATH
(``$CXX``, else ``g++`` / ``c++``) against the headers that ship in the TensorFlow wheel, and cached
(``$TFCS_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/tf_commstrategy`` or ``~/.cache/tf_commstrategy``).
The cached file's name holds a hash of the source, the TensorFlow version, the compiler and the
flags and the compiler's version, so a change of any of them builds anew; one rank builds while the
others wait on its lock file (at most ``LOCK_WAIT_S``), into a private file renamed into place, and a
cached file that another user owns or could have written is not loaded. No compiler, or a build that
fails: ``library()`` says why, and the strategy keeps the ``tf.numpy_function`` path (``TFCS_NATIVE=1``
makes that an error).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Optional, Tuple

log = logging.getLogger("tf_commstrategy")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "shm_allreduce.cc")
BUILD_TIMEOUT_S = 600.0
#: Seconds a process waits for another one's build of the op (the cache's lock) before it gives up and
#: keeps the Python path: longer than a build may take.
LOCK_WAIT_S = BUILD_TIMEOUT_S + 60.0

_lock = threading.Lock()
_result: Optional[Tuple[object, str]] = None  # (the loaded op module or None, why not)
path: Optional[str] = None  # the loaded library's file (its C entry points are reached with ctypes)


def cache_dir(environ=None) -> str:
    env = os.environ if environ is None else environ
    if env.get("TFCS_NATIVE_CACHE"):
        return env["TFCS_NATIVE_CACHE"]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tf_commstrategy")


def _compiler(environ=None) -> Optional[str]:
    env = os.environ if environ is None else environ
    for name in ([env["CXX"]] if env.get("CXX") else []) + ["g++", "c++"]:
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_flags() -> list:
    """Vector instructions this CPU has (the build is for this machine; the hash keeps builds apart)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if {"avx2", "fma"} <= set(flags) else []


def build_command(compiler: str, source: str, target: str) -> list:
    import tensorflow as tf
    return ([compiler, "-shared", "-fPIC", "-O3", "-Wno-deprecated-declarations"] + _cpu_flags() +
            [source, "-o", target] + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags())


def library() -> Tuple[object, str]:
    """The loaded op module (``.tfcs_shm_all_reduce``), built first if needed, or (None, why not)."""
    global _result
    with _lock:
        if _result is None:
            _result = _build_and_load()
        return _result


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _trusted(target: str) -> Optional[str]:
    """Why the cached library must not be loaded (another user's file, or writable by others), or None."""
    st = os.stat(target)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        return (f"{target} belongs to another user or is writable by others (mode {st.st_mode & 0o777:o}); "
                "remove it, or set TFCS_NATIVE_CACHE to a directory of your own")
    return None


def _build_and_load() -> Tuple[object, str]:
    global path
    import tensorflow as tf
    compiler = _compiler()
    if compiler is None:
        return None, "no C++ compiler on the PATH (install g++, or set CXX)"
    try:
        with open(SOURCE, "rb") as f:
            source = f.read()
    except OSError as e:
        return None, f"the op's source is missing ({e})"
    probe = build_command(compiler, SOURCE, "OUT")
    key = hashlib.sha256(source + tf.__version__.encode() + " ".join(probe).encode() +
                         _compiler_version(compiler).encode()).hexdigest()[:20]
    folder = cache_dir()
    target = os.path.join(folder, f"shm_allreduce-{key}.so")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        lock = open(os.path.join(folder, f".build-{key}.lock"), "a")  # per key: builds of others never queue it
    except OSError as e:
        return None, f"cannot write the build cache {folder} ({e}; set TFCS_NATIVE_CACHE)"
    with lock:
        if not os.path.exists(target):  # built already: no need to wait for the lock
            why = _wait_for_lock(lock)  # one build per machine: the ranks that start together wait for it
            if why:
                return None, why
            if not os.path.exists(target):
                why = _build(compiler, folder, target)
                if why:
                    return None, why
    why = _trusted(target)
    if why:
        return None, why
    try:
        lib = tf.load_op_library(target)
    except Exception as e:  # noqa: BLE001 - a stale or broken file: say so, keep the Python path
        return None, f"cannot load {target} ({e}); delete it to rebuild"
    path = target
    return lib, ""


def _wait_for_lock(lock) -> str:
    """Take the cache's build lock, waiting at most ``LOCK_WAIT_S`` for another process's build; "" or
    why not (the caller then keeps the Python path)."""
    import fcntl
    end = time.monotonic() + LOCK_WAIT_S
    pause = 0.01
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return ""
        except BlockingIOError:
            pass
        except OSError as e:
            return f"cannot lock {lock.name} ({e}; set TFCS_NATIVE_CACHE to a local directory)"
        if time.monotonic() >= end:
            return (f"another process has held the build lock {lock.name} for {LOCK_WAIT_S:.0f} s, longer "
                    f"than a build may take (a hung or stopped build); find it with `fuser {lock.name}` and "
                    "stop it, or set TFCS_NATIVE_CACHE to another directory")
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _build(compiler: str, folder: str, target: str) -> str:
    """Compile into ``target`` (through a private file renamed into place); "" or why it failed."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
        os.close(fd)
    except OSError as e:
        return f"cannot write the build cache {folder} ({e}; set TFCS_NATIVE_CACHE)"
    log.info("tf_commstrategy: building the compiled all-reduce op (once per machine, ~10 s) into %s", target)
    try:
        run = subprocess.run(build_command(compiler, SOURCE, tmp), capture_output=True, text=True,
                             timeout=BUILD_TIMEOUT_S)
        if run.returncode != 0:
            errors = [line for line in run.stderr.splitlines() if "error" in line][:3]
            return f"the build failed ({compiler}): " + " | ".join(errors or run.stderr.splitlines()[-3:])
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: no rank ever loads a half-written file
        return ""
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the build failed ({e})"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
