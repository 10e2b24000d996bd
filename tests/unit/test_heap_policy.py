"""The heap policy of CommStrategy (``heap.plan``): pure decisions, nothing applied."""

import pytest

from tf_commstrategy import heap
from tf_commstrategy.errors import ConfigurationError


def test_auto_applies_on_glibc_when_nobody_chose():
    p = heap.plan("auto", environ={}, is_glibc=True)
    assert p.apply and "32 MiB" in p.reason and "512 MiB" in p.reason


def test_off_and_other_c_libraries_change_nothing():
    assert not heap.plan("off", environ={}, is_glibc=True).apply
    p = heap.plan("auto", environ={}, is_glibc=False)
    assert not p.apply and "not glibc" in p.reason


@pytest.mark.parametrize("env, named", [
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc"),
    ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "tcmalloc"),
])
def test_the_users_own_allocator_settings_win(env, named):
    p = heap.plan("auto", environ=env, is_glibc=True)
    assert not p.apply and named in p.reason


def test_unrelated_tunables_and_preloads_do_not_count_as_a_choice():
    env = {"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "LD_PRELOAD": "libfaketime.so"}
    assert heap.plan("auto", environ=env, is_glibc=True).apply


def test_environment_variable_is_read_when_no_argument():
    assert not heap.plan(None, environ={"TFCS_HEAP": "off"}, is_glibc=True).apply
    assert heap.plan(None, environ={}, is_glibc=True).apply  # default "auto"
    assert heap.plan("auto", environ={"TFCS_HEAP": "off"}, is_glibc=True).apply  # the argument wins


@pytest.mark.parametrize("bad", ["sometimes", 2, ""])
def test_invalid_settings_are_refused_with_the_fix(bad):
    with pytest.raises(ConfigurationError, match='"auto" or "off"'):
        heap.plan(bad, environ={}, is_glibc=True)


def test_an_invalid_environment_variable_is_named():
    with pytest.raises(ConfigurationError, match="TFCS_HEAP='lots'"):
        heap.plan(None, environ={"TFCS_HEAP": "lots"}, is_glibc=True)


def test_this_machine_is_seen_as_glibc():
    assert heap.glibc() is not None  # the CI image is glibc Linux: the auto path is the one exercised
