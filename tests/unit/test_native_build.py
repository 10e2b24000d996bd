"""Building the compiled all-reduce: where it is cached, what changes its key, what a failed build, a
missing compiler or a cache of another user's says (the strategy then keeps the Python path;
TFCS_NATIVE=1 turns that into an error), the deadline of the wait for another build, the prebuild
command, and the op's lookup of its segment by name (unregistered, shut down) in one process."""

import ctypes
import errno
import mmap
import os
import secrets
import shutil
import subprocess
import sys
import time
import types

import pytest

from tf_commstrategy.tf import native_build as NB

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None
needs_cxx = pytest.mark.skipif(not HAVE_CXX, reason="no C++ compiler: the compiled all-reduce cannot be built here")


@pytest.fixture
def fresh(monkeypatch):
    """``library()`` as in a new process: nothing loaded yet (the real result comes back afterwards)."""
    monkeypatch.setattr(NB, "_result", None)
    monkeypatch.setattr(NB, "path", NB.path)
    monkeypatch.setattr(NB, "cdll", NB.cdll)


def test_the_cache_follows_the_environment(tmp_path):
    assert NB.cache_dir({"TFCS_NATIVE_CACHE": str(tmp_path)}) == str(tmp_path)
    assert NB.cache_dir({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "tf_commstrategy")
    assert NB.cache_dir({}).endswith(os.path.join(".cache", "tf_commstrategy"))


def test_no_compiler_is_a_reason_not_an_exception(monkeypatch, tmp_path, fresh):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("TFCS_NATIVE_CACHE", str(tmp_path))
    lib, why = NB.library()
    assert lib is None and "no C++ compiler" in why and "install g++" in why, why
    assert "python -m tf_commstrategy.tf.native_build" in why  # the way to have it without one


def test_a_failing_build_says_so_and_leaves_no_partial_file(monkeypatch, tmp_path, fresh):
    failing = tmp_path / "cxx"
    failing.write_text("#!/bin/sh\necho 'shm_allreduce.cc:1: error: no such header' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    cache = tmp_path / "cache"
    monkeypatch.setenv("TFCS_NATIVE_CACHE", str(cache))
    lib, why = NB.library()
    assert lib is None and "the build failed" in why and "no such header" in why
    left = os.listdir(cache)  # the private build file is gone, nothing half-written is cached: only the lock
    assert len(left) == 1 and left[0].startswith(".build-") and left[0].endswith(".lock"), left


def test_a_compiler_that_fails_silently_is_named_with_its_status(monkeypatch, tmp_path, fresh):
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("TFCS_NATIVE_CACHE", str(tmp_path / "cache"))
    lib, why = NB.library()
    assert lib is None and "/bin/false exited with status 1" in why, why


def test_the_build_command_holds_tensorflows_flags_and_the_key_changes_with_them():
    cmd = NB.build_command("/usr/bin/g++", NB.SOURCE, "/tmp/out.so")
    assert cmd[0] == "/usr/bin/g++" and "-shared" in cmd and NB.SOURCE in cmd
    assert any(a.startswith("-I") and "tensorflow" in a for a in cmd)  # the wheel's headers
    assert any("tensorflow_framework" in a for a in cmd)
    assert os.path.exists(NB.SOURCE)  # shipped with the package


def test_a_cached_library_another_user_could_have_written_is_not_loaded(tmp_path):
    planted = tmp_path / "shm_allreduce-x.so"
    planted.write_bytes(b"not a library")
    planted.chmod(0o666)  # writable by everyone
    why = NB._trusted(str(planted))
    assert why is not None and "writable by others" in why and "mode 666" in why
    planted.chmod(0o755)
    assert NB._trusted(str(planted)) is None
    planted.unlink()
    why = NB._trusted(str(planted))  # gone meanwhile: a reason, not an exception
    assert why is not None and "cannot read" in why


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_a_cached_library_of_another_user_is_not_loaded(tmp_path):
    planted = tmp_path / "shm_allreduce-x.so"
    planted.write_bytes(b"not a library")
    planted.chmod(0o755)
    os.chown(planted, 4242, 4242)
    why = NB._trusted(str(planted))
    assert why is not None and "belongs to uid 4242" in why, why


def test_a_cache_directory_others_can_write_is_refused_with_a_reason(monkeypatch, tmp_path, fresh):
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)  # what TFCS_NATIVE_CACHE=/tmp-like directories look like
    monkeypatch.setenv("TFCS_NATIVE_CACHE", str(cache))
    lib, why = NB.library()
    assert lib is None and "writable by others" in why and "mode 777" in why and "chmod go-w" in why, why
    assert os.listdir(cache) == []  # nothing built, no lock taken there
    if os.getuid() == 0:
        cache.chmod(0o755)
        os.chown(cache, 4242, 4242)
        monkeypatch.setattr(NB, "_result", None)
        lib, why = NB.library()
        assert lib is None and "belongs to uid 4242" in why, why


def test_library_never_raises(monkeypatch, fresh):
    def broken(folder, wait_s=None):
        raise RuntimeError("a surprise")
    monkeypatch.setattr(NB, "_build_and_load", broken)
    lib, why = NB.library()
    assert lib is None and "RuntimeError: a surprise" in why
    assert NB._result is None  # not kept: a later call tries again


def _fake_toolchain(monkeypatch, tmp_path):
    """A compiler that is never run to build (``_build`` is replaced) and a loader that loads nothing:
    the lock's logic alone, in a cache of this test's own."""
    import tensorflow as tf
    cxx = tmp_path / "cxx"
    cxx.write_text("#!/bin/sh\necho fake 1.0\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("TFCS_NATIVE_CACHE", str(cache))
    loaded = object()
    monkeypatch.setattr(tf, "load_op_library", lambda p: loaded)
    entry_points = types.SimpleNamespace(**{name: object() for name in NB.ENTRY_POINTS})
    monkeypatch.setattr(NB, "ctypes", types.SimpleNamespace(CDLL=lambda p: entry_points))
    built = []

    def build(compiler, folder, target, timeout_s):
        with open(target, "wb") as f:
            f.write(b"a library")
        os.chmod(target, 0o755)
        built.append(target)
        return "", True
    monkeypatch.setattr(NB, "_build", build)
    return cache, loaded, built


def _in_thread(fn):
    import threading
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "waited on the build lock without a deadline"
    return out[0]


def test_waiting_for_another_processs_build_ends_at_the_deadline_passed(monkeypatch, tmp_path, fresh):
    """A build lock held past the caller's deadline (the strategy passes its rendezvous timeout) is a
    reason, not a hang, and a reason that a later call retries."""
    import fcntl
    cache, loaded, built = _fake_toolchain(monkeypatch, tmp_path)
    assert NB.LOCK_WAIT_S > 60  # the default is far off: the deadline passed is what ends the wait
    assert _in_thread(NB.library) == (loaded, "") and len(built) == 1  # the lock file of this key is there now
    os.unlink(built[0])
    monkeypatch.setattr(NB, "_result", None)
    (lock_name,) = [n for n in os.listdir(cache) if n.endswith(".lock")]
    with open(cache / lock_name, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process is "building" this key
        t0 = time.monotonic()
        lib, why = _in_thread(lambda: NB.library(wait_s=1.0))
        took = time.monotonic() - t0
    assert 0.9 < took < 5, took
    assert lib is None and "held the build lock" in why and "fuser" in why and "TFCS_NATIVE_CACHE" in why, why
    assert len(built) == 1  # it did not build behind the holder's back
    assert _in_thread(lambda: NB.library(wait_s=1.0)) == (loaded, "")  # lock free now: the retry builds
    assert len(built) == 2


def test_a_library_built_already_is_loaded_without_the_build_lock(monkeypatch, tmp_path, fresh):
    """The lock is for builders only: a process that finds the op built does not wait on it."""
    import fcntl
    cache, loaded, built = _fake_toolchain(monkeypatch, tmp_path)
    assert _in_thread(NB.library) == (loaded, "")
    monkeypatch.setattr(NB, "_result", None)
    (lock_name,) = [n for n in os.listdir(cache) if n.endswith(".lock")]
    with open(cache / lock_name, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _in_thread(lambda: NB.library(wait_s=0.2)) == (loaded, "")
    assert len(built) == 1


def test_without_a_compiler_a_prebuilt_library_of_the_same_source_is_loaded(monkeypatch, tmp_path, fresh):
    """A container image keeps the op built by ``python -m tf_commstrategy.tf.native_build`` and may drop
    the compiler: the cache is searched by the source's key, whatever compiler built it."""
    cache, loaded, built = _fake_toolchain(monkeypatch, tmp_path)
    assert _in_thread(NB.library) == (loaded, "")
    monkeypatch.setattr(NB, "_result", None)
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert NB.library() == (loaded, "") and NB.path == built[0]
    monkeypatch.setattr(NB, "_result", None)
    os.chmod(built[0], 0o777)  # the only candidate is refused: the reason says so
    lib, why = NB.library()
    assert lib is None and "no C++ compiler" in why and "writable by others" in why, why


def _run_prebuild(cache, env=None):
    full = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))
    return subprocess.run([sys.executable, "-m", "tf_commstrategy.tf.native_build", "--cache", str(cache)],
                          capture_output=True, text=True, env=full, timeout=600, cwd=ROOT)


def test_the_prebuild_command_without_a_working_compiler_exits_non_zero_with_the_reason(tmp_path):
    run = _run_prebuild(tmp_path / "cache", {"CXX": "/bin/false"})
    assert run.returncode == 1, (run.returncode, run.stdout, run.stderr)
    assert "cannot build the compiled all-reduce" in run.stderr and "/bin/false exited with status 1" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow
@needs_cxx
def test_the_prebuild_command_builds_into_the_cache_and_a_job_without_a_compiler_loads_it(tmp_path):
    cache = tmp_path / "image-cache"
    run = _run_prebuild(cache)
    assert run.returncode == 0, (run.stdout, run.stderr)
    (built,) = [n for n in os.listdir(cache) if n.endswith(".so")]
    assert built in run.stdout and f"TFCS_NATIVE_CACHE={cache}" in run.stdout
    # a job in that image: the cache set, no compiler on the PATH
    check = ("from tf_commstrategy.tf import native_build as NB; lib, why = NB.library(); "
             "print(lib is not None, NB.path, why)")
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", TFCS_NATIVE_CACHE=str(cache),
               PATH=str(tmp_path / "empty"), CXX="")
    job = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=300)
    assert job.stdout.split()[:2] == ["True", str(cache / built)], (job.stdout, job.stderr)


# -- the op's segment is found by name when it runs (one process: the real library) ------------------------

@pytest.fixture(scope="module")
def op_library():
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: the compiled all-reduce cannot be built here")
    lib, why = NB.library()
    assert lib is not None, why
    return lib


def _call(lib, name, timeout=0.3):
    """The op on one tensor, eagerly: (the typed error it raised, TF's error), or (None, None)."""
    import tensorflow as tf
    from tf_commstrategy.tf.native_path import typed_error
    try:
        lib.tfcs_shm_all_reduce(inputs=[tf.ones([3])], segment=name, timeout=timeout, spin_us=0, mean=False,
                                diverge_s=5.0)
    except tf.errors.OpError as e:
        return typed_error(e), e
    return None, None


def test_an_unregistered_segment_name_is_a_typed_error(op_library):
    """A graph exported and run in another process names a segment this process never registered."""
    from tf_commstrategy import errors
    ours, theirs = _call(op_library, "tfcs-shm-0-native-never-registered")
    assert "[tfcs-native:unregistered]" in str(theirs), theirs
    assert isinstance(ours, errors.NotInitializedError), ours
    assert "not registered in this process" in str(ours) and "trace the function anew" in str(ours)


def test_a_registered_segment_is_found_by_name_and_a_released_one_says_shut_down(op_library):
    from tf_commstrategy import errors
    from tf_commstrategy.tf import native_path
    size = 2
    length = native_path._header_bytes(size) + 2 * size * native_path.SLOT_BYTES
    region = mmap.mmap(-1, length)  # stands in for the shared segment: this process is rank 0 of 2
    seg = types.SimpleNamespace(path=f"/dev/shm/tfcs-shm-test-native-{secrets.token_hex(8)}", mm=region,
                                addr=ctypes.addressof(ctypes.c_char.from_buffer(region)))
    name = native_path.segment_name(seg)
    assert native_path._register(seg, 0, size, [os.getpid(), os.getpid()]) == ""
    assert "File exists" in native_path._register(seg, 0, size, [os.getpid(), os.getpid()])  # one entry per name
    assert "Invalid argument" in native_path._register(seg, 2, size, [os.getpid(), os.getpid()])  # rank >= size
    t0 = time.monotonic()
    ours, theirs = _call(op_library, name, timeout=0.3)  # found: it waits for rank 1, which never comes
    assert isinstance(ours, errors.CollectiveTimeoutError), theirs
    assert time.monotonic() - t0 < 5
    assert native_path._release(seg) == 0
    ours, theirs = _call(op_library, name)
    assert "[tfcs-native:shutdown]" in str(theirs) and isinstance(ours, errors.NotInitializedError), theirs
    assert native_path._release(seg) == 0  # twice: nothing more to do
    missing = types.SimpleNamespace(path="/dev/shm/tfcs-shm-never")
    assert native_path._release(missing) == errno.ENOENT
