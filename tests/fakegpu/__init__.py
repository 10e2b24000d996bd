"""A stand-in for cupy + NCCL on machines without a GPU, for testing the nccl backend's own logic.

``install()`` puts modules named ``cupy``, ``cupy.cuda`` and ``cupy.cuda.nccl`` into
``sys.modules``. Their "GPU arrays" are numpy arrays in host memory (``ndarray``, whose module
claims to be cupy); their ``NcclCommunicator`` runs every collective for real across the job's
processes over tf_commstrategy's grpc backend, addressed by raw pointers as NCCL is. So the nccl
backend's code (dtype/op mapping, padding of uneven all-gathers and reduce-scatters, means,
bfloat16, grouped calls, signature checks, deadlines and aborts) runs unchanged in real
multi-process jobs, and the tests compare its results with numpy.

What it does NOT test: NCCL itself, CUDA streams, device memory. That is what tests/gpu and
tests/gpu/run_gpu_checks.sh do on a real GPU.

Fault injection (environment variables, read when a communicator is created):
  FAKE_NCCL_HANG_AT=k   the k-th collective (0-based) of this rank never completes (its event stays
                        pending): the backend's deadline must fire and abort the communicator.
  FAKE_NCCL_ASYNC_ERROR_AT=k   after the k-th collective, check_async_error raises NcclError.

``FAKE_CUPY_MAJOR=14`` (read by ``install``) makes the unique id bytes, as cupy 14 has it (cupy 13:
a tuple of C char values).
"""

from __future__ import annotations

import ctypes
import os
import sys
import types

import numpy as np

from tf_commstrategy.core.reduce_ops import BFLOAT16, ReduceOp

# -- cupy.cuda.nccl constants (the values of nccl.h) ---------------------------------------------
_DT = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
       6: np.float16, 7: np.float32, 8: np.float64, 9: BFLOAT16}
_OP = {0: ReduceOp.SUM, 1: ReduceOp.PROD, 2: ReduceOp.MAX, 3: ReduceOp.MIN}

# what a test can read back from this process
log = {"aborted": 0, "destroyed": 0, "collectives": 0, "groups": 0, "uids": []}


class _Ptr:
    def __init__(self, ptr):
        self.ptr = ptr


class Device:
    def __init__(self, device_id=0):
        self.id = int(device_id)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def use(self):
        return self


class ndarray(np.ndarray):
    """A host array that the code under test takes for a cupy GPU array."""

    @property
    def data(self):
        return _Ptr(self.ctypes.data)

    @property
    def device(self):
        return Device(0)

    def get(self, stream=None):
        return np.array(self, copy=True).view(np.ndarray)

    def toDlpack(self):
        return np.asarray(self).__dlpack__()


ndarray.__module__ = "cupy"


def _wrap(a):
    return np.ascontiguousarray(a).view(ndarray)


def _view(ptr, count, dtype):
    dtype = np.dtype(dtype)
    raw = (ctypes.c_char * (int(count) * dtype.itemsize)).from_address(int(ptr)) if count else None
    return np.frombuffer(raw, dtype=dtype) if raw is not None else np.empty(0, dtype)


class NcclError(RuntimeError):
    pass


class _Event:
    def __init__(self, block=False, disable_timing=True):
        self._pending = False

    def record(self, stream=None):
        self._pending = _state["hung"]

    @property
    def done(self):
        return not self._pending


_state = {"hung": False, "depth": 0, "queue": [], "p2p": [], "cupy_major": 13}


class NcclCommunicator:
    def __init__(self, ndev, uid, rank):
        if _state["cupy_major"] >= 14:  # cupy 14: ``__init__(self, int ndev, bytes commId, int rank)``
            if not isinstance(uid, bytes):
                raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(uid).__name__})")
            if len(uid) != 128:
                raise ValueError("commId must be 128 bytes")
        else:
            # as cupy 13's ``__init__(self, int ndev, tuple commId, int rank)`` fills a C ``char[128]`` (x86: signed)
            if not isinstance(uid, tuple):
                raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(uid).__name__})")
            if len(uid) != 128 or any(not -128 <= c <= 127 for c in uid):
                raise OverflowError("value too large to convert to char")
            uid = np.array(uid, dtype=np.int8).tobytes()
        from tf_commstrategy.process import default_group
        self._grpc = default_group().backend("grpc")
        self._rank, self._size = rank, ndev
        self._count = 0
        self._hang_at = int(os.environ.get("FAKE_NCCL_HANG_AT", "-1"))
        self._err_at = int(os.environ.get("FAKE_NCCL_ASYNC_ERROR_AT", "-1"))
        ids = self._grpc.allgather(np.frombuffer(bytes(uid), dtype=np.uint8).copy())  # every rank joins
        log["uids"].append(ids.reshape(ndev, -1).tolist())
        self.alive = True

    # -- collectives on raw pointers, run over the grpc ring --------------------------------------
    def _submit(self, fn, call):
        if _state["depth"]:
            _state["queue"].append(lambda: self._do(fn, call))
        else:
            self._do(fn, call)

    def _do(self, fn, call):
        if not self.alive:
            raise NcclError("communicator aborted")
        if self._count == self._hang_at:
            _state["hung"] = True
        self._count += 1
        log["collectives"] += 1
        if _state["hung"]:
            return
        # as NCCL, a call whose kind, count, type or op/root differs between the ranks never completes
        # (NCCL hangs or mixes data up): the ranks compare the call first, over the grpc ring
        calls = self._grpc.allgather(np.array(call, dtype=np.int64)).reshape(self._size, -1)
        if (calls != calls[0]).any():
            _state["hung"] = True
            log["mismatched"] = log.get("mismatched", 0) + 1
            return
        fn()

    def allReduce(self, send, recv, count, dt, op, stream):
        def run():
            r = self._grpc.allreduce(_view(send, count, _DT[dt]).copy(), _OP[op])
            _view(recv, count, _DT[dt])[:] = r
        self._submit(run, (0, count, dt, op))

    def broadcast(self, send, recv, count, dt, root, stream):
        def run():
            r = self._grpc.broadcast(_view(send, count, _DT[dt]).copy(), root)
            _view(recv, count, _DT[dt])[:] = r
        self._submit(run, (1, count, dt, root))

    def allGather(self, send, recv, count, dt, stream):
        def run():
            r = self._grpc.allgather(_view(send, count, _DT[dt]).copy())
            _view(recv, count * self._size, _DT[dt])[:] = r
        self._submit(run, (2, count, dt, 0))

    def reduceScatter(self, send, recv, count, dt, op, stream):
        def run():
            full = self._grpc.allreduce(_view(send, count * self._size, _DT[dt]).copy(), _OP[op])
            _view(recv, count, _DT[dt])[:] = full[self._rank * count:(self._rank + 1) * count]
        self._submit(run, (3, count, dt, op))

    # point to point: queued inside a group, run at its end as one all-to-all of bytes over the grpc ring
    def send(self, buf, count, dt, peer, stream):
        _state["p2p"].append((self, "send", buf, count, dt, peer))

    def recv(self, buf, count, dt, peer, stream):
        _state["p2p"].append((self, "recv", buf, count, dt, peer))

    def _exchange(self, ops):
        sends = {peer: _view(buf, count, _DT[dt]).view(np.uint8) for _, kind, buf, count, dt, peer in ops
                 if kind == "send"}
        recvs = {peer: (buf, count, dt) for _, kind, buf, count, dt, peer in ops if kind == "recv"}
        payload = np.concatenate([sends.get(p, np.empty(0, np.uint8)) for p in range(self._size)])
        got, got_splits = self._grpc.alltoall(payload, [sends[p].size if p in sends else 0
                                                        for p in range(self._size)])
        off = 0
        for p, n in enumerate(got_splits):
            if p in recvs:
                buf, count, dt = recvs[p]
                want = _view(buf, count, _DT[dt]).view(np.uint8)
                if n != want.size:  # NCCL would hang or corrupt data; the fake says so
                    raise NcclError(f"recv of {want.size} bytes from rank {p}, which sent {n}")
                want[:] = got[off:off + n]
            off += n

    def check_async_error(self):
        if 0 <= self._err_at < self._count:
            raise NcclError("NCCL_ERROR_REMOTE_ERROR: injected asynchronous error")

    def abort(self):
        self.alive = False
        _state["hung"] = False
        log["aborted"] += 1

    def destroy(self):
        self.alive = False
        log["destroyed"] += 1


def _group_start():
    _state["depth"] += 1


def _group_end():
    _state["depth"] -= 1
    if _state["depth"] == 0:
        log["groups"] += 1
        queue, _state["queue"] = _state["queue"], []
        for fn in queue:
            fn()
        p2p, _state["p2p"] = _state["p2p"], []
        if p2p:
            comm = p2p[0][0]
            comm._submit(lambda: comm._exchange(p2p), (4, len(p2p), 0, 0))


def install():
    """Put the fake ``cupy`` / ``cupy.cuda`` / ``cupy.cuda.nccl`` into ``sys.modules``."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    nccl = types.ModuleType("cupy.cuda.nccl")
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1,
                                    memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    stream = types.SimpleNamespace(ptr=0)
    cuda.Device, cuda.Event, cuda.runtime = Device, _Event, runtime
    cuda.get_current_stream = lambda: stream
    cuda.alloc_pinned_memory = _pinned
    cuda.nccl = nccl
    for name, value in [("NCCL_INT8", 0), ("NCCL_CHAR", 0), ("NCCL_UINT8", 1), ("NCCL_INT32", 2), ("NCCL_INT", 2),
                        ("NCCL_UINT32", 3), ("NCCL_INT64", 4), ("NCCL_UINT64", 5), ("NCCL_FLOAT16", 6),
                        ("NCCL_HALF", 6), ("NCCL_FLOAT32", 7), ("NCCL_FLOAT", 7), ("NCCL_FLOAT64", 8),
                        ("NCCL_DOUBLE", 8), ("NCCL_BFLOAT16", 9), ("NCCL_SUM", 0), ("NCCL_PROD", 1),
                        ("NCCL_MAX", 2), ("NCCL_MIN", 3), ("NCCL_AVG", 4)]:
        setattr(nccl, name, value)
    nccl.available = True
    nccl.NcclCommunicator, nccl.NcclError = NcclCommunicator, NcclError
    # cupy 13 returns the id as a tuple of C char values: signed on x86, so bytes >= 128 come out
    # negative; cupy 14 returns bytes (FAKE_CUPY_MAJOR=14 acts as cupy 14)
    _state["cupy_major"] = int(os.environ.get("FAKE_CUPY_MAJOR", "13"))
    if _state["cupy_major"] >= 14:
        nccl.get_unique_id = lambda: os.urandom(128)
    else:
        nccl.get_unique_id = lambda: tuple(np.frombuffer(os.urandom(128), dtype=np.int8).tolist())
    nccl.get_version = lambda: 99999
    nccl.groupStart, nccl.groupEnd = _group_start, _group_end
    cupy.cuda, cupy.ndarray = cuda, ndarray
    for name in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
                 "float64", "bool_"):
        setattr(cupy, name, getattr(np, name))
    cupy.empty = lambda shape, dtype=np.float32: np.empty(shape, dtype).view(ndarray)
    cupy.ones = lambda shape, dtype=np.float32: np.ones(shape, dtype).view(ndarray)
    cupy.zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype).view(ndarray)
    cupy.asarray = lambda a, dtype=None: _wrap(np.asarray(a, dtype=dtype))
    cupy.ascontiguousarray = _wrap
    cupy.concatenate = lambda parts, axis=0: _wrap(np.concatenate([np.asarray(p) for p in parts], axis=axis))
    cupy.moveaxis = lambda a, s, d: np.moveaxis(a, s, d).view(ndarray)
    cupy.asnumpy = lambda a: np.array(a, copy=True).view(np.ndarray)
    cupy.from_dlpack = lambda x: _wrap(np.from_dlpack(x))
    cupy.where = lambda c, a, b: _wrap(np.where(np.asarray(c), np.asarray(a), np.asarray(b)))
    cupy.isnan = lambda a: np.isnan(np.asarray(a))
    # what tests/gpu uses beyond the backend (its dry run on this fake: TFCS_GPU_DRYRUN=1)
    cupy.__version__ = "fake"
    cupy.arange = lambda *a, dtype=None: _wrap(np.arange(*a, dtype=dtype))
    cupy.full = lambda shape, value, dtype=np.float32: np.full(shape, value, dtype).view(ndarray)
    cupy.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    runtime.getDeviceProperties = lambda i: {"name": b"fake GPU (host memory)"}
    cuda.Stream = _Stream
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl})
    return cupy


class _Stream:
    """``cupy.cuda.Stream``: a context manager; the fake runs everything synchronously."""

    def __init__(self, non_blocking=False):
        self.ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _pinned(nbytes):
    """``cupy.cuda.alloc_pinned_memory``: host memory with ``.ptr`` and the buffer protocol."""
    cls = type("PinnedMemoryPointer", (ctypes.c_char * nbytes,), {"ptr": property(ctypes.addressof)})
    return cls()
