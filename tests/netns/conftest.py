"""Network-namespace "hosts" for the multi-host tests: root and `ip netns` are needed, else every test skips."""

import pytest

from tests.netns import hosts as H


@pytest.fixture(scope="session")
def netns_available():
    reason = H.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    H.cleanup_stale()  # namespaces left by earlier runs that were killed
    return True


@pytest.fixture(autouse=True)
def _needs_netns(netns_available):
    """Every test in this directory needs namespaces (skips cleanly otherwise)."""


@pytest.fixture
def make_hosts():
    """``make_hosts(n, **kw)`` -> NetnsHosts; everything built is torn down after the test, pass or fail."""
    built = []

    def make(n, **kw):
        h = H.NetnsHosts(n, **kw)
        built.append(h)
        return h
    try:
        yield make
    finally:
        for h in built:
            h.close()
