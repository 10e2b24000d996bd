"""Host-side logic of the nccl backend: the unique id between cupy (a tuple of C char values) and the store,
and the bfloat16 rounding of a mean (run on numpy here; on cupy on a GPU)."""

import time

import numpy as np
import pytest

from tf_commstrategy.backends.nccl.communicator import comm_id, exchange_unique_id, new_nccl_communicator
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


def test_a_one_process_job_makes_its_id_without_a_store():
    raw = bytes(range(128))
    assert exchange_unique_id(None, 0, 0, 1.0, lambda: raw) == raw  # cupy >= 14 gives bytes


def _cupy_nccl(kind):
    """The argument checks of cupy's NcclCommunicator(ndev, commId, rank), as each cupy build makes them."""
    made = []

    class NcclCommunicator:
        def __init__(self, ndev, comm_id, rank):
            if kind == "cupy14":
                if not isinstance(comm_id, bytes):
                    raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                                    f"{type(comm_id).__name__})")
            else:
                if not isinstance(comm_id, tuple):
                    raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got "
                                    f"{type(comm_id).__name__})")
                lo, hi = (-128, 127) if kind == "cupy13-x86" else (0, 255)
                if any(not lo <= c <= hi for c in comm_id):
                    raise OverflowError("value too large to convert to char")
            made.append(bytes(c & 0xFF for c in comm_id))

    return type("nccl", (), {"NcclCommunicator": NcclCommunicator}), made


@pytest.mark.parametrize("kind", ["cupy13-x86", "cupy13-arm", "cupy14"])
def test_the_communicator_gets_the_id_in_the_form_its_cupy_takes(kind):
    raw = bytes(range(256))[1::2]  # every byte >= 128 half the time
    nccl, made = _cupy_nccl(kind)
    new_nccl_communicator(nccl, 2, raw, 1)
    assert made == [raw]


def test_a_type_error_about_something_else_is_not_swallowed():
    class Refusing:
        def NcclCommunicator(self, ndev, comm_id, rank):
            raise TypeError("an integer is required")
    with pytest.raises(TypeError, match="integer"):
        new_nccl_communicator(Refusing(), 2, bytes(128), 0)


def test_bfloat16_rounding_keeps_nans_and_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from tf_commstrategy.backends.nccl.backend import bf16_bits_from_f32
    # CUDA's canonical NaN (0x7FFFFFFF) and other NaNs with low bits set carried into sign/exponent before
    nans = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F80FFFF], np.uint32).view(np.float32)
    got = bf16_bits_from_f32(nans, np).view(ml_dtypes.bfloat16).astype(np.float32)
    assert np.isnan(got).all()
    assert list(np.signbit(got)) == [False, True, False, False]
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 1e3, np.float32([0, -0.0, np.inf, -np.inf,
                                                                                         3.4e38, 1e-40])])
    want = x.astype(ml_dtypes.bfloat16).view(np.uint16)  # round to nearest even
    np.testing.assert_array_equal(bf16_bits_from_f32(x, np), want)


class _FakeNccl:
    class NcclError(RuntimeError):
        pass


class _FakeComm:
    def __init__(self, error):
        self.error, self.aborted = error, False

    def check_async_error(self):
        raise self.error

    def abort(self):
        self.aborted = True


@pytest.mark.parametrize("error,text", [(KeyError(6), "ncclRemoteError"),  # cupy 13.0-13.3 (cupy#8661)
                                        (_FakeNccl.NcclError("NCCL_ERROR_REMOTE_ERROR: remote process exited"),
                                         "NCCL_ERROR_REMOTE_ERROR")])
def test_an_asynchronous_nccl_error_aborts_the_communicator_and_is_typed(error, text):
    from tf_commstrategy.backends.nccl.communicator import Communicator
    from tf_commstrategy.errors import CollectiveError
    comm = _FakeComm(error)
    c = Communicator(_FakeNccl, comm, 0, 1, 0, 2)
    with pytest.raises(CollectiveError, match=text) as info:
        c.check_async("allreduce op=sum", 5)
    assert comm.aborted and c.comm is None
    assert info.value.rank == 0 and info.value.seq == 5


class _NeverDone:
    """A cupy event behind a collective that never completes."""

    def __init__(self, block=False, disable_timing=True):
        pass

    def record(self, stream=None):
        pass

    done = False


class _HealthyComm:
    def check_async_error(self):
        pass

    def abort(self):
        self.aborted = True


def test_a_rank_told_of_a_failure_gives_its_own_verdict_first(monkeypatch):
    """Another rank saw the mismatch and aborted: this rank must raise the mismatch too, not only the abort."""
    import sys
    import types
    from tf_commstrategy.backends.nccl.communicator import Communicator
    from tf_commstrategy.errors import CollectiveAbortedError, CollectiveMismatchError
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Event=_NeverDone)))
    calls = []

    def verdict(settle=False):  # the check's result arrives only once the rank waits for it
        calls.append(settle)
        if settle:
            raise CollectiveMismatchError("ranks disagree on nccl collective #3", rank=1)

    comm = _HealthyComm()
    c = Communicator(_FakeNccl, comm, 0, 1, 1, 3)
    with pytest.raises(CollectiveMismatchError):
        c.wait(None, time.monotonic() + 5, "allreduce", 3, lambda: CollectiveAbortedError("rank 2 aborted", rank=1),
               on_poll=verdict)
    assert calls == [False, True]
    # without a verdict to give, the control plane's error is raised and the communicator aborted
    comm = _HealthyComm()
    c = Communicator(_FakeNccl, comm, 0, 1, 1, 3)
    with pytest.raises(CollectiveAbortedError):
        c.wait(None, time.monotonic() + 5, "allreduce", 3, lambda: CollectiveAbortedError("rank 2 aborted", rank=1),
               on_poll=lambda settle=False: None)
    assert comm.aborted
