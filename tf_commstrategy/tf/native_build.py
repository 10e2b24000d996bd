"""Build and load the compiled all-reduce op (``native/shm_allreduce.cc``) on first use.

The op is compiled once per machine and TensorFlow version with the C++ compiler found on the PATH
(``$CXX``, else ``g++`` / ``c++``) against the headers that ship in the TensorFlow wheel, and cached
(``$TFCS_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/tf_commstrategy`` or ``~/.cache/tf_commstrategy``).
The cached file's name holds a hash of the source, the TensorFlow version, the compiler and the
flags, so a change of any of them builds anew; ranks that build at the same time each write a
private file and rename it into place. No compiler, or a build that fails: ``library()`` says why,
and the strategy keeps the ``tf.numpy_function`` path (``TFCS_NATIVE=1`` makes that an error).
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
from typing import Optional, Tuple

log = logging.getLogger("tf_commstrategy")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "shm_allreduce.cc")
BUILD_TIMEOUT_S = 600.0

_lock = threading.Lock()
_result: Optional[Tuple[object, str]] = None  # (the loaded op module or None, why not)


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


def _build_and_load() -> Tuple[object, str]:
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
    key = hashlib.sha256(source + tf.__version__.encode() + " ".join(probe).encode()).hexdigest()[:20]
    folder = cache_dir()
    target = os.path.join(folder, f"shm_allreduce-{key}.so")
    if not os.path.exists(target):
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            return None, f"cannot write the build cache {folder} ({e}; set TFCS_NATIVE_CACHE)"
        log.info("tf_commstrategy: building the compiled all-reduce op (once per machine, ~10 s) into %s", target)
        try:
            run = subprocess.run(build_command(compiler, SOURCE, tmp), capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_S)
            if run.returncode != 0:
                errors = [line for line in run.stderr.splitlines() if "error" in line][:3]
                return None, f"the build failed ({compiler}): " + " | ".join(errors or run.stderr.splitlines()[-3:])
            os.replace(tmp, target)  # atomic: a rank building at the same time replaces it with the same bytes
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"the build failed ({e})"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return tf.load_op_library(target), ""
    except Exception as e:  # noqa: BLE001 - a stale or foreign file: say so, keep the Python path
        return None, f"cannot load {target} ({e}); delete it to rebuild"
