"""Building the compiled all-reduce: where it is cached, what changes its key, and what a failed build
or a missing compiler says (the strategy then keeps the Python path; TFCS_NATIVE=1 turns that into an error)."""

import os
import time

from tf_commstrategy.tf import native_build as NB


def test_the_cache_follows_the_environment(tmp_path):
    assert NB.cache_dir({"TFCS_NATIVE_CACHE": str(tmp_path)}) == str(tmp_path)
    assert NB.cache_dir({"XDG_CACHE_HOME": "/x"}) == os.path.join("/x", "tf_commstrategy")
    assert NB.cache_dir({}).endswith(os.path.join(".cache", "tf_commstrategy"))


def test_no_compiler_is_a_reason_not_an_exception(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("TFCS_NATIVE_CACHE", str(tmp_path))
    lib, why = NB._build_and_load()
    assert lib is None and "no C++ compiler" in why


def test_a_failing_build_says_so_and_leaves_no_partial_file(monkeypatch, tmp_path):
    failing = tmp_path / "cxx"
    failing.write_text("#!/bin/sh\necho 'shm_allreduce.cc:1: error: no such header' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    cache = tmp_path / "cache"
    monkeypatch.setenv("TFCS_NATIVE_CACHE", str(cache))
    lib, why = NB._build_and_load()
    assert lib is None and "the build failed" in why and "no such header" in why
    left = os.listdir(cache)  # the private build file is gone, nothing half-written is cached: only the lock
    assert len(left) == 1 and left[0].startswith(".build-") and left[0].endswith(".lock"), left


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
    assert why is not None and "writable by others" in why
    planted.chmod(0o755)
    assert NB._trusted(str(planted)) is None


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
    built = []

    def build(compiler, folder, target):
        with open(target, "wb") as f:
            f.write(b"a library")
        os.chmod(target, 0o755)
        built.append(target)
        return ""
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


def test_waiting_for_another_processs_build_has_a_deadline(monkeypatch, tmp_path):
    """A build lock held past any build's length (a hung or stopped process) is a reason, not a hang."""
    import fcntl
    cache, _loaded, built = _fake_toolchain(monkeypatch, tmp_path)
    monkeypatch.setattr(NB, "LOCK_WAIT_S", 0.5)
    lib, why = _in_thread(NB._build_and_load)  # builds: the lock file of this key is there now
    assert why == "" and len(built) == 1
    os.unlink(built[0])
    (lock_name,) = [n for n in os.listdir(cache) if n.endswith(".lock")]
    with open(cache / lock_name, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process is "building" this key
        t0 = time.monotonic()
        lib, why = _in_thread(NB._build_and_load)
        assert time.monotonic() - t0 < 5
    assert lib is None and "held the build lock" in why and "fuser" in why and "TFCS_NATIVE_CACHE" in why, why
    assert len(built) == 1  # it did not build behind the holder's back


def test_a_library_built_already_is_loaded_without_the_build_lock(monkeypatch, tmp_path):
    """The lock is for builders only: a process that finds the op built does not wait on it."""
    import fcntl
    cache, loaded, built = _fake_toolchain(monkeypatch, tmp_path)
    assert _in_thread(NB._build_and_load) == (loaded, "")
    (lock_name,) = [n for n in os.listdir(cache) if n.endswith(".lock")]
    monkeypatch.setattr(NB, "LOCK_WAIT_S", 0.2)
    with open(cache / lock_name, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _in_thread(NB._build_and_load) == (loaded, "")
    assert len(built) == 1
