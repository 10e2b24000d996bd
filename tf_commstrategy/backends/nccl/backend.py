"""The nccl backend: every collective of the interface on GPU buffers through ``cupy.cuda.nccl``.

Ordering and streams: a call is queued on **cupy's current stream** of the buffers' GPU, so it runs
after everything the caller queued there (the producer of the data), and the call returns only once
the collective has completed on the GPU (``Communicator.wait``, with the deadline), so its result may
be read on any stream. DLPack inputs are imported with the stream protocol, which orders the
producer's stream before ours (see ``buffers``).

Checks: with every call, all ranks all-reduce a 62-bit hash of the call's signature (op, dtype,
shape, root, sequence number) as ``[h, -h]`` with MAX: every rank then sees whether all hashes were
equal, and on a mismatch all raise ``CollectiveMismatchError`` with both signatures (read from the
store). Plain NCCL would hang or corrupt data instead. The check is queued just ahead of the
collective on the same stream, its result copied into pinned host memory behind it, and read while
waiting for the collective: no host round trip between the two. A mismatched collective that hangs
is aborted with the communicator once the check's result is in. ``TFCS_NCCL_CHECK=0`` turns the
check off; a one-rank job needs none. An all-gather exchanges ``[h, rows]`` anyway (for unequal
first dimensions), which doubles as its check.

Failures: a timeout, an asynchronous NCCL error or a failure seen by the control plane aborts the
communicator and fails the process group (peers learn it over the gRPC ring); later calls raise
``CollectiveError`` until the job restarts.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ... import config
from ...core import compression as compression_mod
from ...core.backend import Backend, BackendStats, Capabilities, check_splits
from ...core.reduce_ops import ReduceOp
from ...errors import CollectiveError, CollectiveMismatchError, TfcsError, UnsupportedOperationError
from . import buffers as bufmod
from .buffers import bf16_bits_from_f32
from .communicator import SETTLE_S, Communicator, describe_nccl_error, is_remote_error
from .types import nccl_dtype, nccl_op

log = logging.getLogger("tf_commstrategy")


def signature_hash(sig: str, seq: int) -> int:
    """A 62-bit hash of a call's signature and sequence number (equal on ranks making the same call)."""
    digest = hashlib.blake2b(f"{seq}|{sig}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def _bf16_divide(u16, divisor: int) -> None:
    """In place: bfloat16 bits in a uint16 cupy array divided by ``divisor`` (round to nearest even)."""
    import cupy
    f32 = (u16.astype(cupy.uint32) << 16).view(cupy.float32) / cupy.float32(divisor)
    u16[...] = bf16_bits_from_f32(f32, cupy)


def finish_mean(buf: bufmod.DeviceBuffer, world: int) -> None:
    """Turn a sum into a mean on the device (queued on the current stream); integers floor-divide."""
    if world == 1:
        return
    arr = buf.array
    if buf.dtype == "bfloat16":  # bits in uint16 (Bfloat16Array), or cupy >= 14's own bfloat16 arrays
        _bf16_divide(arr if str(arr.dtype) == "uint16" else arr.view("uint16"), world)
    elif arr.dtype.kind in "iu":
        arr //= world
    else:
        arr /= arr.dtype.type(world)


class SignatureCheck:
    """The per-call signature check of the nccl backend: queues it, reads it, and names a mismatch.

    It keeps 16 bytes of pinned host memory per GPU for the check's result, reused by every call (each
    call waits for its own copy), and reads the peers' signatures from the store to describe a mismatch.
    """

    def __init__(self, nccl, group):
        self._nccl = nccl
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self._host: Dict[int, tuple] = {}

    def mismatch(self, comm: Communicator, sig: str, seq: int, hashes: Sequence[int]) -> CollectiveMismatchError:
        """The error naming this rank's call and a disagreeing peer's call (read from the store).

        This rank publishes its signature first; ``hashes`` (one per rank, or empty when unknown) skip
        the peers known to agree. The peers get 5 seconds together to report theirs.
        """
        store = self.group.store
        key = f"nccl/sig/{comm.generation}/{seq}"
        try:
            store.set(f"{key}/{self.rank}", sig)
        except Exception:  # noqa: BLE001 - the mismatch is the error; the peers then read "(unknown ...)"
            pass
        mine = signature_hash(sig, seq)
        other, theirs = None, "(unknown: it did not report its call in time)"
        end = time.monotonic() + 5.0  # for all the peers together, however many stay silent
        for r in range(self.size):
            if r == self.rank or (hashes and hashes[r] == mine):
                continue
            try:
                text = store.get(f"{key}/{r}", max(0.05, end - time.monotonic()))
            except Exception:
                if other is None:
                    other = r
                continue
            if text != sig:
                other, theirs = r, text
                break
        return CollectiveMismatchError(
            f"ranks disagree on nccl collective #{seq}: this rank called [{sig}], rank {other} called [{theirs}]",
            rank=self.rank, seq=seq, local_signature=sig, remote_signature=theirs, remote_rank=other,
            fix="make every rank issue the same collectives in the same order, with the same op, dtype, shape "
                "and root")

    def queue(self, comm: Communicator, stream, sig: str, seq: int) -> Callable:
        """Queue the signature all-reduce and the copy of its result to pinned host memory on ``stream``.

        Returns ``verify(final=False, settle=False)``: once the check's event is done (always with
        ``final``; ``settle`` first waits up to ``SETTLE_S`` for it), it raises
        ``CollectiveMismatchError`` if the ranks disagreed, after aborting the communicator (the
        mismatched collective may never end); until then it returns at once.
        """
        import cupy
        h = signature_hash(sig, seq)
        host = self._host.get(comm.device_id)
        if host is None:  # 16 bytes of pinned memory per GPU, reused: every call waits for its own copy
            mem = cupy.cuda.alloc_pinned_memory(16)
            host = self._host[comm.device_id] = (mem, np.frombuffer(mem, np.int64, 2))
        chk = cupy.asarray(np.array([h, -h], dtype=np.int64))
        comm.comm.allReduce(chk.data.ptr, chk.data.ptr, 2, self._nccl.NCCL_INT64, self._nccl.NCCL_MAX, stream.ptr)
        cupy.cuda.runtime.memcpyAsync(host[0].ptr, chk.data.ptr, 16, 2, stream.ptr)  # 2: device to host
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        done = False

        def verify(final: bool = False, settle: bool = False) -> None:
            nonlocal done, chk  # chk stays alive until the all-reduce has run
            if done:
                return
            if settle:
                end = time.monotonic() + SETTLE_S
                while not event.done and time.monotonic() < end:
                    time.sleep(1e-4)
            if not (final or event.done):
                return
            done, chk = True, None
            top, neg_low = (int(v) for v in host[1])
            if top != h or neg_low != -h:
                comm.abort()
                raise self.mismatch(comm, sig, seq, [])

        return verify


class NcclBackend(Backend):
    """Collectives over NCCL, one communicator per GPU of this rank (created on first use)."""

    name = "nccl"
    capabilities = Capabilities(device_arrays=True)
    supports_out = False

    def __init__(self, group):
        from cupy.cuda import nccl
        self._nccl = nccl
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.check = config.nccl_check_from_env()
        self._comms: Dict[int, Communicator] = {}
        self._generation = 0
        self._seq = 0
        self._bytes = 0  # BackendStats.collective_bytes
        self._lock = threading.Lock()
        self._failed: Optional[BaseException] = None
        self._checks = SignatureCheck(nccl, group)
        log.info("tf_commstrategy rank %d: nccl backend (NCCL %s, signature checks %s)", self.rank,
                 nccl.get_version(), "on" if self.check else "off")

    # -- plumbing --------------------------------------------------------------------------------
    def _control_failure(self) -> Optional[BaseException]:
        if self._failed is not None:
            return self._failed
        grpc = self.group.built_backend("grpc")
        return grpc.failure() if grpc is not None else None  # its own error, or one another rank reported

    def _comm(self, device_id: int, deadline: float) -> Communicator:
        comm = self._comms.get(device_id)
        if comm is None:
            generation = self._generation
            self._generation += 1
            comm = Communicator.create(self._nccl, self.group.store, self.rank, self.size, device_id,
                                       generation, deadline, self._control_failure,
                                       settings=f"check={int(self.check)}")
            self._comms[device_id] = comm
            log.info("tf_commstrategy rank %d: NCCL communicator #%d on GPU %d (%d ranks)", self.rank,
                     generation, device_id, self.size)
        return comm

    def _run(self, sig: str, device_id: int, timeout: Optional[float], body: Callable, check: bool = True):
        """Run one collective: ``body(comm, stream, seq, deadline)`` queues the work and returns the result."""
        import cupy
        timeout = config.call_timeout(timeout, self.group.timeout, self.rank)
        with self._lock:
            if self._failed is not None:
                raise CollectiveError(f"the nccl backend is unusable after an earlier error: {self._failed}",
                                      rank=self.rank, fix="shut down (tfcs.shutdown()) and restart the job")
            seq = self._seq
            self._seq += 1
            deadline = time.monotonic() + timeout
            try:
                with cupy.cuda.Device(device_id):
                    comm = self._comm(device_id, deadline)
                    stream = cupy.cuda.get_current_stream()
                    verify = None
                    if check and self.check and self.size > 1:
                        verify = self._checks.queue(comm, stream, sig, seq)
                    result = body(comm, stream, seq, deadline)
                    comm.wait(stream, deadline, sig, seq, self._control_failure, on_poll=verify)
                    if verify is not None:
                        verify(final=True)
                    return result
            except TfcsError as e:
                self._fail(e)
                raise
            except Exception as e:
                if isinstance(e, self._nccl.NcclError) or is_remote_error(e):
                    err = CollectiveError(f"NCCL failed in collective #{seq} [{sig}]: {describe_nccl_error(e)}",
                                          rank=self.rank, seq=seq, fix="NCCL_DEBUG=WARN prints NCCL's own diagnosis")
                else:  # out of GPU memory, a size cupy cannot pass, ...: the peers may have queued this
                    # collective already; this rank must not go on to pair its next one with it
                    err = CollectiveError(f"collective #{seq} [{sig}] failed on this rank before NCCL ran it: "
                                          f"{type(e).__name__}: {e}", rank=self.rank, seq=seq,
                                          fix="see the cause above; the job must be restarted "
                                              "(tfcs-run --max-restarts)")
                self._fail(err)
                raise err from e
            except BaseException as e:  # KeyboardInterrupt, SystemExit: what the GPU still runs is unknown
                self._fail(CollectiveError(f"collective #{seq} [{sig}] was interrupted ({type(e).__name__}); the "
                                           f"NCCL communicator was aborted", rank=self.rank, seq=seq,
                                           fix="restart the job (tfcs-run --max-restarts)"))
                raise

    def _fail(self, error: BaseException) -> None:
        if self._failed is not None:
            return
        self._failed = error
        for c in self._comms.values():
            c.abort()
        grpc = self.group.built_backend("grpc")
        if grpc is not None and grpc.failure() is None:
            grpc.abort(error)  # tells every other rank over the control plane

    def _dt(self, buf: bufmod.DeviceBuffer) -> int:
        return nccl_dtype(self._nccl, buf.dtype)

    # -- collectives -----------------------------------------------------------------------------
    def allreduce(self, buf, op: ReduceOp, timeout=None, *, compression: str = "none"):
        b, wrap = bufmod.to_device(buf)
        return wrap(self._compressed_allreduce([b], op, timeout, compression)[0])

    def batch_allreduce(self, bufs: Sequence, op: ReduceOp, timeout=None, *, compression: str = "none") -> List:
        """All buffers in one ``ncclGroupStart/End`` (NCCL fuses their launches)."""
        if not bufs:
            return []
        bs, wraps = bufmod.to_devices(bufs)
        return [w(r) for w, r in zip(wraps, self._compressed_allreduce(bs, op, timeout, compression))]

    def _compressed_allreduce(self, bs: List[bufmod.DeviceBuffer], op: ReduceOp, timeout,
                              compression: str) -> List[bufmod.DeviceBuffer]:
        """``_batch_allreduce``, with the buffers that compression narrows (``core.compression``) moved as
        float16 / bfloat16 (NCCL adds them in that dtype along its ring) and widened back."""
        wires = [compression_mod.wire_dtype(compression, b.dtype, op) for b in bs]
        if not any(w is not None for w in wires):
            return self._batch_allreduce(bs, op, timeout)
        moved = [b if w is None else bufmod.narrowed(b, w) for b, w in zip(bs, wires)]
        reduced = self._batch_allreduce(moved, op, timeout)
        return [r if w is None else bufmod.widened(r, b) for r, b, w in zip(reduced, bs, wires)]

    def _batch_allreduce(self, bs: List[bufmod.DeviceBuffer], op: ReduceOp, timeout) -> List[bufmod.DeviceBuffer]:
        self._bytes += sum(int(b.array.nbytes) for b in bs)
        codes = [(self._dt(b), nccl_op(self._nccl, op, b.dtype)) for b in bs]
        sig = f"allreduce op={op.value} " + " ".join(f"{b.dtype}{list(b.shape)}" for b in bs)
        nccl = self._nccl

        def body(comm, stream, seq, deadline):
            outs = [b.like() for b in bs]
            nccl.groupStart()
            try:
                for b, o, (dt, nop) in zip(bs, outs, codes):
                    comm.comm.allReduce(b.ptr, o.ptr, b.size, dt, nop, stream.ptr)
            finally:
                nccl.groupEnd()
            if op is ReduceOp.MEAN:
                for o in outs:
                    finish_mean(o, self.size)
            return outs

        return self._run(sig, bs[0].device_id, timeout, body)

    def broadcast(self, buf, root: int, timeout=None):
        b, wrap = bufmod.to_device(buf)
        return wrap(self._batch_broadcast([b], root, timeout)[0])

    def batch_broadcast(self, bufs: Sequence, root: int, timeout=None) -> List:
        if not bufs:
            return []
        bs, wraps = bufmod.to_devices(bufs)
        return [w(r) for w, r in zip(wraps, self._batch_broadcast(bs, root, timeout))]

    def _batch_broadcast(self, bs, root: int, timeout):
        self._bytes += sum(int(b.array.nbytes) for b in bs)
        codes = [self._dt(b) for b in bs]
        sig = f"broadcast root={root} " + " ".join(f"{b.dtype}{list(b.shape)}" for b in bs)
        nccl = self._nccl

        def body(comm, stream, seq, deadline):
            outs = [b.like() for b in bs]
            nccl.groupStart()
            try:
                for b, o, dt in zip(bs, outs, codes):
                    comm.comm.broadcast(b.ptr, o.ptr, b.size, dt, root, stream.ptr)
            finally:
                nccl.groupEnd()
            return outs

        return self._run(sig, bs[0].device_id, timeout, body)

    def allgather(self, buf, timeout=None):
        import cupy
        b, wrap = bufmod.to_device(buf)
        self._bytes += int(b.array.nbytes)
        if b.array.ndim == 0:
            b = bufmod.DeviceBuffer(b.array.reshape(1), b.dtype)
        dt = self._dt(b)
        rows = b.shape[0]
        trailing = b.shape[1:]
        sig = f"allgather dtype={b.dtype} trailing={list(trailing)}"
        nccl = self._nccl
        n = self.size

        def body(comm, stream, seq, deadline):
            h = signature_hash(sig, seq)
            meta = cupy.asarray([h, rows], dtype=cupy.int64)
            metas = cupy.empty(2 * n, dtype=cupy.int64)
            comm.comm.allGather(meta.data.ptr, metas.data.ptr, 2, nccl.NCCL_INT64, stream.ptr)
            comm.wait(stream, deadline, f"sizes of [{sig}]", seq, self._control_failure)
            got = [int(v) for v in metas.get(stream=stream)]
            hashes, counts = got[0::2], got[1::2]
            if any(x != h for x in hashes):
                raise self._checks.mismatch(comm, sig, seq, hashes)
            top = max(counts)
            per = _prod(trailing)
            if all(c == top for c in counts):
                out = b.like((n * top,) + trailing)
                comm.comm.allGather(b.ptr, out.ptr, top * per, dt, stream.ptr)
                return out
            padded = b.like((top,) + trailing)
            padded.array[:rows] = b.array
            gathered = b.like((n * top,) + trailing)
            comm.comm.allGather(padded.ptr, gathered.ptr, top * per, dt, stream.ptr)
            parts = [gathered.array[i * top:i * top + c] for i, c in enumerate(counts)]
            return bufmod.DeviceBuffer(cupy.concatenate(parts), b.dtype)

        return wrap(self._run(sig, b.device_id, timeout, body, check=False))

    def alltoall(self, buf, splits=None, timeout=None):
        """One ``allGather`` of [signature hash, splits] (the check and the split table at once), then one
        ``ncclSend`` / ``ncclRecv`` per peer in one group."""
        import cupy
        b, wrap = bufmod.to_device(buf)
        counts = check_splits(b.array, splits, self.size, self.rank)
        self._bytes += int(b.array.nbytes)
        dt = self._dt(b)
        trailing = b.shape[1:]
        per = _prod(trailing)
        sig = f"alltoall dtype={b.dtype} trailing={list(trailing)}"
        nccl, n, me = self._nccl, self.size, self.rank
        item = b.array.dtype.itemsize

        def body(comm, stream, seq, deadline):
            h = signature_hash(sig, seq)
            meta = cupy.asarray([h] + counts, dtype=cupy.int64)
            metas = cupy.empty((n + 1) * n, dtype=cupy.int64)
            comm.comm.allGather(meta.data.ptr, metas.data.ptr, n + 1, nccl.NCCL_INT64, stream.ptr)
            comm.wait(stream, deadline, f"splits of [{sig}]", seq, self._control_failure)
            table = [[int(v) for v in row] for row in metas.get(stream=stream).reshape(n, n + 1)]
            if any(row[0] != h for row in table):
                raise self._checks.mismatch(comm, sig, seq, [row[0] for row in table])
            received = [table[o][1 + me] for o in range(n)]
            out = b.like((sum(received),) + trailing)
            send_off = [sum(counts[:d]) for d in range(n)]
            recv_off = [sum(received[:o]) for o in range(n)]
            nccl.groupStart()
            try:
                for p in range(n):
                    comm.comm.send(b.ptr + send_off[p] * per * item, counts[p] * per, dt, p, stream.ptr)
                    comm.comm.recv(out.ptr + recv_off[p] * per * item, received[p] * per, dt, p, stream.ptr)
            finally:
                nccl.groupEnd()
            return out, received

        out, received = self._run(sig, b.device_id, timeout, body, check=False)
        return wrap(out), received

    def reduce_scatter(self, buf, op: ReduceOp, timeout=None):
        b, wrap = bufmod.to_device(buf)
        self._bytes += int(b.array.nbytes)
        if b.array.ndim == 0:
            raise UnsupportedOperationError("reduce_scatter needs at least one dimension to split",
                                            rank=self.rank, fix="reshape the scalar to shape (1,)")
        dt, nop = self._dt(b), nccl_op(self._nccl, op, b.dtype)
        n, rows, trailing = self.size, b.shape[0], b.shape[1:]
        sizes = [rows // n + (1 if i < rows % n else 0) for i in range(n)]
        starts = [sum(sizes[:i]) for i in range(n)]
        per = int(_prod(trailing))
        sig = f"reduce_scatter op={op.value} dtype={b.dtype} shape={list(b.shape)}"

        def body(comm, stream, seq, deadline):
            top = max(sizes)
            out = b.like((top,) + trailing)
            if all(s == top for s in sizes):
                comm.comm.reduceScatter(b.ptr, out.ptr, top * per, dt, nop, stream.ptr)
            else:
                padded = b.like((n * top,) + trailing)
                padded.array[...] = 0
                for i in range(n):
                    padded.array[i * top:i * top + sizes[i]] = b.array[starts[i]:starts[i] + sizes[i]]
                comm.comm.reduceScatter(padded.ptr, out.ptr, top * per, dt, nop, stream.ptr)
            mine = bufmod.DeviceBuffer(out.array[:sizes[self.rank]], b.dtype)
            if op is ReduceOp.MEAN:
                finish_mean(mine, n)
            return mine

        return wrap(self._run(sig, b.device_id, timeout, body))

    def barrier(self, timeout=None) -> None:
        import cupy
        device = cupy.cuda.Device().id

        def body(comm, stream, seq, deadline):
            token = cupy.ones(1, dtype=cupy.int32)
            comm.comm.allReduce(token.data.ptr, token.data.ptr, 1, self._nccl.NCCL_INT32, self._nccl.NCCL_SUM,
                                stream.ptr)

        self._run("barrier", device, timeout, body)

    def accepts(self, buf) -> bool:
        return bufmod.is_device_buffer(buf)

    # -- lifecycle -------------------------------------------------------------------------------
    def stats(self) -> BackendStats:
        return BackendStats(collectives=self._seq, collective_bytes=self._bytes)

    def abort(self, error: BaseException) -> None:
        if self._failed is None:
            self._failed = error
        for c in self._comms.values():
            c.abort()

    def close(self) -> None:
        comms, self._comms = list(self._comms.values()), {}
        failed = self._control_failure() is not None
        for c in comms:
            if failed:  # a peer may be gone: ncclCommDestroy could wait for it, ncclCommAbort does not
                c.abort()
            else:
                c.destroy()


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
