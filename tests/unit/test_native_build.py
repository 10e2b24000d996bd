"""Building the compiled all-reduce: where it is cached, what changes its key, and what a failed build
or a missing compiler says (the strategy then keeps the Python path; TFCS_NATIVE=1 turns that into an error)."""

import os

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
    assert os.listdir(cache) == [".build.lock"]  # the private build file is gone, nothing half-written is cached


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
