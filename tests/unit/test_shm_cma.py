"""Cross-memory attach (shm_cma): the process_vm_readv wrapper and the setup probe, in one process.

The probe's two "ranks" run in two threads of this process (a process may read itself), talking
through a blocking in-memory store as they would through the coordinator."""

import errno
import json
import os
import threading

import numpy as np
import pytest

from tf_commstrategy.backends.host import shm_cma
from tf_commstrategy.errors import RendezvousError


def _readable_here():
    try:
        shm_cma.read_array(os.getpid(), np.ones(1).ctypes.data, np.empty(1))
    except OSError as e:
        return str(e)
    return None


pytestmark = pytest.mark.skipif(_readable_here() is not None, reason=f"process_vm_readv refused: {_readable_here()}")


def test_read_copies_another_address_range_byte_for_byte_across_calls_of_any_size():
    src = np.random.default_rng(0).integers(0, 255, (3 << 20) + 17, dtype=np.uint8)  # not a page multiple
    dst = np.zeros_like(src)
    shm_cma.read_array(os.getpid(), src.ctypes.data, dst)
    assert dst.tobytes() == src.tobytes()
    part = np.zeros(1000, np.float64)
    f = np.arange(5000, dtype=np.float64)
    shm_cma.read_array(os.getpid(), f.ctypes.data + 123 * 8, part)
    np.testing.assert_array_equal(part, f[123:1123])
    shm_cma.read_array(os.getpid(), f.ctypes.data, np.empty(0))  # nothing to read: no call, no error


def test_read_of_an_unmapped_range_or_a_missing_process_raises_the_kernels_errno():
    with pytest.raises(OSError) as e:
        shm_cma.read(os.getpid(), np.empty(16, np.uint8).ctypes.data, 8, 16)  # address 8: never mapped
    assert e.value.errno == errno.EFAULT and "process_vm_readv" in str(e.value)
    with pytest.raises(OSError) as e:
        shm_cma.read(2 ** 22 + 12345, np.empty(16, np.uint8).ctypes.data, np.empty(16).ctypes.data, 16)
    assert e.value.errno == errno.ESRCH


class _BlockingStore:
    def __init__(self):
        self.kv, self.cv = {}, threading.Condition()

    def set(self, key, value):
        with self.cv:
            self.kv[key] = value
            self.cv.notify_all()

    def get(self, key, timeout):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.kv, timeout):
                raise RendezvousError(f"no {key} within {timeout} s")
            return self.kv[key]


def _probe_pair(min_bytes, pids=None, store=None):
    store = store or _BlockingStore()
    pids = pids or [os.getpid(), os.getpid()]
    out = {}

    def rank(r):
        out[r] = shm_cma.probe(store, "cma", r, 2, pids, min_bytes[r], 10)[:2]
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    return out, store


def test_probe_agrees_on_the_largest_threshold_when_every_rank_reads_every_token():
    out, store = _probe_pair([1 << 20, 4 << 20])
    assert out == {0: (4 << 20, None), 1: (4 << 20, None)}
    # what travelled over the store: an address and a random token, never the same twice
    t0, t1 = (json.loads(store.kv[f"cma/token/{r}"]) for r in range(2))
    assert t0["token"] != t1["token"] and len(bytes.fromhex(t0["token"])) == shm_cma.TOKEN_BYTES


def test_probe_turns_the_path_off_for_every_rank_when_one_rank_turns_it_off():
    out, _ = _probe_pair([1 << 20, 0])
    assert out[0] == (0, "rank 1: turned off (TFCS_SHM_CMA=0)")
    assert out[1] == (0, "turned off (TFCS_SHM_CMA=0)")


def test_probe_turns_the_path_off_for_every_rank_when_a_read_fails_or_reads_another_value():
    # rank 1's "pid" is a process that does not exist: rank 0 cannot read it
    out, _ = _probe_pair([1 << 20, 1 << 20], pids=[os.getpid(), 2 ** 22 + 12345])
    assert out[0][0] == 0 and out[0][1].startswith(f"cannot read rank 1's memory (pid {2 ** 22 + 12345})")
    assert out[1] == (0, out[0][1].replace("cannot read", "rank 0: cannot read", 1))
    # a published address whose bytes are not the token (another process under that pid, or a lie)
    store = _BlockingStore()
    decoy = np.zeros(shm_cma.TOKEN_BYTES, np.uint8)
    real_set = store.set

    def forging_set(key, value):
        if key == "cma/token/1":
            value = json.dumps(dict(json.loads(value), addr=int(decoy.ctypes.data)))
        real_set(key, value)
    store.set = forging_set
    out, _ = _probe_pair([1 << 20, 1 << 20], store=store)
    assert out[0] == (0, f"read another value than rank 1 published (pid {os.getpid()} is not that rank here)")
    assert out[1][0] == 0 and out[1][1].startswith("rank 0: read another value")


class _Prctl:
    """Stands in for libc's prctl: records the PR_SET_PTRACER calls."""

    def __init__(self):
        self.calls = []

    def prctl(self, option, arg, *_):
        self.calls.append((option, arg))
        return 0


def test_yama_scope_reads_the_sysctl_and_is_0_without_yama(tmp_path, monkeypatch):
    f = tmp_path / "ptrace_scope"
    f.write_text("1\n")
    monkeypatch.setattr(shm_cma, "YAMA_SCOPE", str(f))
    assert shm_cma.yama_scope() == 1
    monkeypatch.setattr(shm_cma, "YAMA_SCOPE", str(tmp_path / "absent"))
    assert shm_cma.yama_scope() == 0


def test_only_the_one_peer_of_a_pair_is_named_under_yama_scope_1_and_withdrawn_with_the_last_group(monkeypatch):
    fake = _Prctl()
    monkeypatch.setattr(shm_cma, "_syscalls", lambda: fake)
    monkeypatch.setattr(shm_cma, "_named", {"pid": 0, "uses": 0})
    monkeypatch.setattr(shm_cma, "yama_scope", lambda: 0)
    assert shm_cma.allow_peer_to_read([4242]) is None and fake.calls == []  # nothing to loosen
    monkeypatch.setattr(shm_cma, "yama_scope", lambda: 1)
    assert shm_cma.allow_peer_to_read([4242, 4343]) is None and fake.calls == []  # never "anyone"
    assert shm_cma.allow_peer_to_read([4242]) == 4242
    assert shm_cma.allow_peer_to_read([4242]) == 4242  # a second group with the same peer
    assert shm_cma.allow_peer_to_read([4343]) is None  # Yama keeps one reader: not replaced
    assert fake.calls == [(shm_cma.PR_SET_PTRACER, 4242)]
    shm_cma.forget_reader(4343)
    shm_cma.forget_reader(None)
    shm_cma.forget_reader(4242)
    assert fake.calls == [(shm_cma.PR_SET_PTRACER, 4242)]  # one group still reads
    shm_cma.forget_reader(4242)
    assert fake.calls == [(shm_cma.PR_SET_PTRACER, 4242), (shm_cma.PR_SET_PTRACER, 0)]


def test_a_failed_probe_withdraws_the_reader_it_named(monkeypatch):
    fake = _Prctl()
    monkeypatch.setattr(shm_cma, "_syscalls", lambda: fake)
    monkeypatch.setattr(shm_cma, "_named", {"pid": 0, "uses": 0})
    monkeypatch.setattr(shm_cma, "yama_scope", lambda: 1)
    # rank 0 takes part (names pid 999999: its one peer), rank 1 turned the reads off
    store = _BlockingStore()
    store.set("cma/token/1", json.dumps({"addr": 0, "token": "", "bytes": 0, "why": "turned off (TFCS_SHM_CMA=0)"}))
    store.set("cma/ok/1", "0:turned off (TFCS_SHM_CMA=0)")
    assert shm_cma.probe(store, "cma", 0, 2, [os.getpid(), 999999], 1 << 20, 5) == (
        0, "rank 1: turned off (TFCS_SHM_CMA=0)", None)
    assert fake.calls == [(shm_cma.PR_SET_PTRACER, 999999), (shm_cma.PR_SET_PTRACER, 0)]
