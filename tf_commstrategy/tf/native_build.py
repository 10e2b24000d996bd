"""Build and load the compiled all-reduce op (``native/shm_allreduce.cc``) on first use, or ahead of time.

The op is compiled once per machine and TensorFlow version with the C++ compiler found on the PATH
(``$CXX``, else ``g++`` / ``c++``) against the headers that ship in the TensorFlow wheel, and cached
(``$TFCS_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/tf_commstrategy`` or ``~/.cache/tf_commstrategy``).
The cached file's name holds two hashes: one of the source, the TensorFlow version and the flags (the
CPU's vector instructions among them), one of the compiler's path and version; a change of any of them
builds anew. A process without a compiler loads a library of the first hash built by any compiler
(one prebuilt into a container image: ``python -m tf_commstrategy.tf.native_build``).

One process builds while the others on the machine wait on its lock file, at most until the deadline
their caller passes (the strategy passes its rendezvous deadline, the time its peers wait for this
rank's answer); the build goes into a private file renamed into place. The cache directory and the
library must belong to this user (or root) and be writable by nobody else, else nothing is loaded.

``library()`` never raises: no compiler, a failed build, a refused cache or anything unexpected is a
reason (the strategy then keeps the ``tf.numpy_function`` path and logs it; ``TFCS_NATIVE=1`` makes
that an error).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Tuple

from .. import config

log = logging.getLogger("tf_commstrategy")

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native", "shm_allreduce.cc")
BUILD_TIMEOUT_S = config.NATIVE_BUILD_TIMEOUT_S
LOCK_WAIT_S = config.NATIVE_LOCK_WAIT_S
#: The C entry points that native_path reaches with ctypes: a library without them is not this source's.
ENTRY_POINTS = ("TfcsShmRegister", "TfcsShmRelease")
PREBUILD_COMMAND = "python -m tf_commstrategy.tf.native_build"

_lock = threading.Lock()
_result: Optional[Tuple[object, str]] = None  # (the loaded op module or None, why not), once final
path: Optional[str] = None  # the loaded library's file
cdll: Optional[ctypes.CDLL] = None  # the same library for its C entry points (ctypes)


def cache_dir(environ=None) -> str:
    chosen = config.native_cache_from_env(environ)
    if chosen:
        return chosen
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tf_commstrategy")


def _compiler(environ=None) -> Optional[str]:
    env = os.environ if environ is None else environ
    for name in ([env["CXX"]] if env.get("CXX") else []) + ["g++", "c++"]:
        found = shutil.which(name)
        if found:
            return found
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


def library(wait_s: Optional[float] = None) -> Tuple[object, str]:
    """The loaded op module (``.tfcs_shm_all_reduce``), built first if needed, or (None, why not).

    Args:
      wait_s: seconds that waiting for another process's build and this process's own build may take
        in all (None: ``LOCK_WAIT_S`` for the wait, ``BUILD_TIMEOUT_S`` for the build). A reason that
        comes from this deadline is not kept: a later call tries again.

    Never raises (an unexpected error is a reason too).
    """
    global _result
    with _lock:
        if _result is not None:
            return _result
        try:
            lib, why, final = _build_and_load(cache_dir(), wait_s)
        except Exception as e:  # noqa: BLE001 - the loader's promise: a reason, never an exception
            lib, why, final = None, (f"unexpected error while building or loading the op ({type(e).__name__}: "
                                     f"{e}); run `{PREBUILD_COMMAND}` to see it"), False
        if final:
            _result = (lib, why)
        return lib, why


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _hash(*parts: str, n: int) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:n]


def _source_key() -> str:
    """The hash of what the library's code depends on, the compiler aside: source, TF version, flags."""
    import tensorflow as tf
    with open(SOURCE, "rb") as f:
        source = f.read().decode("utf-8", "replace")
    return _hash(source, tf.__version__, " ".join(build_command("CXX", SOURCE, "OUT")[1:]), n=16)


def _compiler_key(compiler: str) -> str:
    return _hash(compiler, _compiler_version(compiler), n=8)


def _owner_and_mode_why(what: str, st: os.stat_result, fix: str) -> Optional[str]:
    """Why a cache directory or library with this owner and mode must not be trusted, or None."""
    me = os.getuid()
    if st.st_uid not in (me, 0):
        return (f"{what} belongs to uid {st.st_uid}, expected this user (uid {me}) or root: another user could "
                f"have put any code there; {fix}")
    if st.st_mode & 0o022:
        return (f"{what} is writable by others (mode {st.st_mode & 0o777:o}, expected no group or other write "
                f"permission): another user could replace the library; {fix}")
    return None


_OWN_DIR_FIX = "set TFCS_NATIVE_CACHE to a directory of your own"


def _refusal(path: str, what: str, is_kind, kind: str, fix: str, mode_fix: str) -> Optional[str]:
    """Why ``path`` (``what``, for the message) must not be used: unreadable, not a ``kind``, another
    user's or writable by others; else None."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot read {what} ({e}); {fix}"
    if not is_kind(st.st_mode):
        return f"{what} is not a {kind}; {fix}"
    return _owner_and_mode_why(what, st, mode_fix)


def _check_dir(folder: str) -> Optional[str]:
    """Why the cache directory must not be used (another user's, or writable by others), or None."""
    return _refusal(folder, f"the build cache {folder}", stat.S_ISDIR, "directory", _OWN_DIR_FIX,
                    f"`chmod go-w {folder}`, or {_OWN_DIR_FIX}")


def _trusted(target: str) -> Optional[str]:
    """Why the cached library must not be loaded (another user's file, or writable by others), or None."""
    return _refusal(target, target, stat.S_ISREG, "regular file", "delete it to rebuild",
                    f"delete it to rebuild, or {_OWN_DIR_FIX}")


def _mtime(p: str) -> float:
    try:
        return os.stat(p).st_mtime
    except OSError:
        return 0.0


def _prebuilt(folder: str, source_key: str) -> Tuple[Optional[str], str]:
    """Without a compiler: the newest library of this source key in ``folder`` that passes
    ``_trusted``, or (None, why there is none)."""
    found = sorted(glob.glob(os.path.join(glob.escape(folder), f"shm_allreduce-{source_key}-*.so")),
                   key=_mtime, reverse=True)
    refused = []
    for candidate in found:
        why = _trusted(candidate)
        if why is None:
            return candidate, ""
        refused.append(why)
    why = (f"no C++ compiler on the PATH (install g++, or set CXX) and no prebuilt op in {folder} for this "
           f"source, TensorFlow version and CPU (prebuild one with `{PREBUILD_COMMAND}`)")
    return None, why + (f"; refused: {refused[0]}" if refused else "")


def _build_and_load(folder: str, wait_s: Optional[float] = None) -> Tuple[object, str, bool]:
    """(the op module or None, why not, whether that verdict holds for the life of the process)."""
    deadline = time.monotonic() + (LOCK_WAIT_S if wait_s is None else max(0.0, float(wait_s)))
    build_s = BUILD_TIMEOUT_S if wait_s is None else None  # None: what is left of the deadline
    if os.path.isdir(folder):
        why = _check_dir(folder)
        if why:
            return None, why, True
    try:
        key = _source_key()
    except OSError as e:
        return None, f"the op's source is missing ({e}); reinstall tf_commstrategy", True
    compiler = _compiler()
    if compiler is None:
        target, why = _prebuilt(folder, key)
        if target is None:
            return None, why, True
    else:
        target = os.path.join(folder, f"shm_allreduce-{key}-{_compiler_key(compiler)}.so")
        if not os.path.exists(target):  # built already: no need to wait for the lock
            why, final = _build_locked(compiler, folder, target, deadline, build_s)
            if why:
                return None, why, final
    return _load(target)


def _build_locked(compiler: str, folder: str, target: str, deadline: float,
                  build_s: Optional[float]) -> Tuple[str, bool]:
    """Build ``target`` under the cache's lock (one build per machine: the ranks that start together
    wait for it); ("", True), or (why not, whether that is final: a passed deadline is not)."""
    try:
        # readable by everyone (a cache prebuilt by root into an image serves every user), writable by its owner
        os.makedirs(folder, mode=0o755, exist_ok=True)
    except OSError as e:
        return f"cannot write the build cache {folder} ({e}; set TFCS_NATIVE_CACHE)", True
    why = _check_dir(folder)
    if why:
        return why, True
    key = os.path.basename(target)[len("shm_allreduce-"):-len(".so")]
    lock_path = os.path.join(folder, f".build-{key}.lock")
    try:
        lock = open(lock_path, "a")  # per key: builds of others never queue it
    except OSError as e:
        return f"cannot write the build cache {folder} ({e}; set TFCS_NATIVE_CACHE)", True
    with lock:
        why = _wait_for_lock(lock, deadline)
        if why:
            return why, False
        if os.path.exists(target):  # another process built it while this one waited
            return "", True
        left = deadline - time.monotonic()
        return _build(compiler, folder, target, build_s if build_s is not None else left)


def _load(target: str) -> Tuple[object, str, bool]:
    global path, cdll
    import tensorflow as tf
    why = _trusted(target)
    if why:
        return None, why, True
    try:
        lib = tf.load_op_library(target)
        handle = ctypes.CDLL(target)  # the same handle as TF's (one dlopen of one path): the same table
        missing = [name for name in ENTRY_POINTS if not hasattr(handle, name)]
    except Exception as e:  # noqa: BLE001 - a stale or broken file: say so, keep the Python path
        return None, f"cannot load {target} ({e}); delete it to rebuild", True
    if missing:
        return None, f"{target} lacks {', '.join(missing)} (another version's build); delete it to rebuild", True
    path, cdll = target, handle
    return lib, "", True


def _wait_for_lock(lock, deadline: float) -> str:
    """Take the cache's build lock, waiting until ``deadline`` (time.monotonic) for another process's
    build; "" or why not (the caller then keeps the Python path)."""
    import fcntl
    start = time.monotonic()
    pause = 0.01
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return ""
        except BlockingIOError:
            pass
        except OSError as e:
            return f"cannot lock {lock.name} ({e}; set TFCS_NATIVE_CACHE to a local directory)"
        now = time.monotonic()
        if now >= deadline:
            return (f"another process has held the build lock {lock.name} for the {now - start:.1f} s this rank "
                    f"could wait (its deadline), longer than a build takes (~10 s): a hung or stopped build; "
                    f"find it with `fuser {lock.name}` and stop it, prebuild the op with `{PREBUILD_COMMAND}`, "
                    "or set TFCS_NATIVE_CACHE to another directory")
        time.sleep(max(0.0, min(pause, deadline - now)))
        pause = min(pause * 2, 0.5)


def _build(compiler: str, folder: str, target: str, timeout_s: float) -> Tuple[str, bool]:
    """Compile into ``target`` (through a private file renamed into place) within ``timeout_s``; ("",
    True), or (why it failed, whether that is final: a build cut short by the deadline is not)."""
    if timeout_s <= 0:
        return (f"no time left to build the op before the deadline; prebuild it with `{PREBUILD_COMMAND}`",
                False)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
        os.close(fd)
    except OSError as e:
        return f"cannot write the build cache {folder} ({e}; set TFCS_NATIVE_CACHE)", True
    log.info("tf_commstrategy: building the compiled all-reduce op (once per machine, ~10 s) into %s", target)
    try:
        run = subprocess.run(build_command(compiler, SOURCE, tmp), capture_output=True, text=True,
                             timeout=timeout_s)
        if run.returncode != 0:
            lines = run.stderr.splitlines()
            errors = [line for line in lines if "error" in line][:3] or lines[-3:]
            said = " | ".join(errors) if errors else "no output"
            return f"the build failed ({compiler} exited with status {run.returncode}: {said})", True
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: no rank ever loads a half-written file
        return "", True
    except subprocess.TimeoutExpired:
        return (f"the build did not finish within {timeout_s:.0f} s (the deadline); prebuild the op with "
                f"`{PREBUILD_COMMAND}`"), False
    except OSError as e:
        return f"the build failed ({e})", True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv=None) -> int:
    """``python -m tf_commstrategy.tf.native_build``: build the op into the cache (e.g. in a container
    image's build), load it to check it, and say where it is; 0, or 1 with the reason on stderr."""
    parser = argparse.ArgumentParser(
        prog=PREBUILD_COMMAND, description="Build tf_commstrategy's compiled all-reduce op into its cache, so "
                                           "that jobs load it without compiling (or without a compiler).")
    parser.add_argument("--cache", help="the cache directory (default: $TFCS_NATIVE_CACHE, else "
                                        "$XDG_CACHE_HOME/tf_commstrategy or ~/.cache/tf_commstrategy); jobs "
                                        "must see the same one (set TFCS_NATIVE_CACHE)")
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds for waiting on another build and building (default: {LOCK_WAIT_S:.0f} s "
                             f"for the wait, {BUILD_TIMEOUT_S:.0f} s for the build)")
    args = parser.parse_args(argv)
    folder = os.path.abspath(args.cache or cache_dir())
    try:
        lib, why, _ = _build_and_load(folder, args.timeout)
    except Exception as e:  # noqa: BLE001 - a message and a status, never a traceback
        lib, why = None, f"unexpected error ({type(e).__name__}: {e})"
    if lib is None:
        print(f"tf_commstrategy: cannot build the compiled all-reduce into {folder}: {why}", file=sys.stderr)
        return 1
    print(f"tf_commstrategy: the compiled all-reduce is ready: {path}")
    if folder != os.path.abspath(cache_dir()):
        print(f"tf_commstrategy: set TFCS_NATIVE_CACHE={folder} where the jobs run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
