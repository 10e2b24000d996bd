"""The thread-pool policy of CommStrategy (``tf/threads.plan``): pure decisions, no TF state touched."""

import pytest

from tf_commstrategy.errors import ConfigurationError
from tf_commstrategy.tf import threads


def test_auto_splits_the_cores_among_the_hosts_workers():
    assert threads.plan("auto", local_size=2, cores=2, environ={}).threads == 1
    assert threads.plan("auto", local_size=4, cores=32, environ={}).threads == 8
    assert threads.plan("auto", local_size=3, cores=8, environ={}).threads == 2
    assert threads.plan("auto", local_size=4, cores=2, environ={}).threads == 1  # never below one


def test_auto_leaves_a_worker_alone_on_its_host():
    p = threads.plan("auto", local_size=1, cores=16, environ={})
    assert p.threads is None and "one worker" in p.reason


def test_users_tf_variables_win_over_auto():
    p = threads.plan("auto", local_size=2, cores=2, environ={"TF_NUM_INTRAOP_THREADS": "2"})
    assert p.threads is None and "TF_NUM_INTRAOP_THREADS" in p.reason


def test_environment_variable_is_read_when_no_argument():
    assert threads.plan(None, 2, 2, environ={"TFCS_TF_THREADS": "off"}).threads is None
    assert threads.plan(None, 2, 8, environ={"TFCS_TF_THREADS": "3"}).threads == 3
    assert threads.plan(None, 2, 8, environ={}).threads == 4  # default "auto"


def test_explicit_argument_beats_the_environment():
    assert threads.plan(2, 2, 8, environ={"TFCS_TF_THREADS": "off"}).threads == 2
    assert threads.plan("off", 2, 8, environ={"TFCS_TF_THREADS": "3"}).threads is None
    # an explicit count is applied even with one worker per host
    assert threads.plan(6, 1, 8, environ={}).threads == 6


@pytest.mark.parametrize("bad", ["many", -1, "-2", 1.5, True])
def test_invalid_settings_are_refused_with_the_fix(bad):
    with pytest.raises(ConfigurationError) as e:
        threads.plan(bad, 2, 2, environ={})
    assert "auto" in str(e.value) and "off" in str(e.value)


def test_invalid_environment_value_names_the_variable():
    with pytest.raises(ConfigurationError) as e:
        threads.plan(None, 2, 2, environ={"TFCS_TF_THREADS": "lots"})
    assert "TFCS_TF_THREADS='lots'" in str(e.value)
