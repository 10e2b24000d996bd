"""The NCCL unique id between cupy's form (a tuple of C char values) and the store (base64 of bytes)."""

import numpy as np
import pytest

from tf_commstrategy.backends.nccl.communicator import comm_id, exchange_unique_id
from tf_commstrategy.errors import RendezvousError


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value

    def get(self, key, timeout):
        if key not in self.kv:
            raise RendezvousError(f"key {key!r} did not appear")
        return self.kv[key]


def test_a_signed_char_id_travels_and_comes_back_as_cupy_takes_it():
    raw = bytes(range(256))[::2]  # 128 bytes, half of them >= 128
    from_cupy = tuple(np.frombuffer(raw, np.int8).tolist())  # what cupy returns on x86
    assert min(from_cupy) < 0
    store = _Store()
    uid0 = exchange_unique_id(store, 0, 3, 1.0, lambda: from_cupy)
    uid1 = exchange_unique_id(store, 1, 3, 1.0, lambda: pytest.fail("only rank 0 makes the id"))
    assert uid0 == uid1 == raw
    assert comm_id(uid1) == from_cupy  # the same values cupy produced
    assert comm_id(uid1, signed=False) == tuple(raw)  # where char is unsigned (Arm, POWER)


def test_a_missing_or_malformed_id_is_a_rendezvous_error():
    store = _Store()
    with pytest.raises(RendezvousError, match="did not publish"):
        exchange_unique_id(store, 1, 0, 0.1, lambda: None)
    store.set("nccl/uid/0", "AAAA")
    with pytest.raises(RendezvousError, match="expected 128"):
        exchange_unique_id(store, 1, 0, 0.1, lambda: None)
