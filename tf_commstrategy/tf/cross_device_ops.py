"""``CommCrossDeviceOps``: reduce over this worker's replicas, then across workers in one fused call.

Data path of one ``batch_reduce`` (e.g. all gradients of a train step):

1. local: each value's per-replica components are summed on the first local device (``tf.add_n``);
2. across workers: in the graph, the local sums are concatenated into one flat tensor per dtype (cut
   into ``bytes_per_pack`` buckets when asked); ONE stateful ``numpy_function`` runs one all-reduce per
   flat buffer, written straight into the tensors it returns; the results are split and reshaped
   back in the graph (static shapes kept);
3. MEAN: with one replica per worker the collective itself averages (each rank divides its own
   segment); with several, the sum is divided by the global replica count. Each result is copied
   to its destination devices.

IndexedSlices (embedding gradients) are all-gathered (values and indices), not densified.
Public methods validate (TF's ``CrossDeviceOps``), ``*_implementation`` methods do the work.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cdo
from tensorflow.python.distribute import distribute_utils, reduce_util
from tensorflow.python.distribute import values as value_lib
from tensorflow.python.framework import indexed_slices

from ..core.reduce_ops import ReduceOp
from . import options as opts
from . import tensor_ops


def _values(v) -> List:
    return list(v.values) if isinstance(v, value_lib.DistributedValues) else [v]


def _array_module(a):
    """numpy for host arrays, cupy for the nccl path's device arrays."""
    if type(a).__module__.split(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def fusion_groups(dtypes: List, nbytes: List[int], bytes_per_pack: int) -> List[List[int]]:
    """Indices of the tensors that travel together: one group per dtype (in order of first appearance),
    cut into buckets of at most ``bytes_per_pack`` bytes (0 or less: no cut). A tensor larger than the
    pack size is a bucket of its own.

    Args:
      dtypes: each tensor's dtype.
      nbytes: each tensor's size in bytes (-1 when unknown until run time: such a tensor closes its bucket).
      bytes_per_pack: the bucket size from the options.

    Returns:
      The groups, each a list of indices in their original order.
    """
    by_dtype: dict = {}
    for i, d in enumerate(dtypes):
        by_dtype.setdefault(d, []).append(i)
    out = []
    for idxs in by_dtype.values():
        cur, size = [], 0
        for i in idxs:
            n = nbytes[i]
            if cur and bytes_per_pack and bytes_per_pack > 0 and (n < 0 or size + n > bytes_per_pack):
                out.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += max(n, 0)
        if cur:
            out.append(cur)
    return out


def _static_nbytes(t) -> int:
    if not t.shape.is_fully_defined():
        return -1
    return int(t.shape.num_elements()) * t.dtype.size


def check_transport(group, wanted: str, where: str) -> None:
    """Raise unless ``CommOptions(transport=wanted)`` runs on the links ``group`` set up when the job
    started (the same verdict on every rank: ``serves_transport``).

    Raises:
      ConfigurationError: the job's links use another transport.
    """
    if not group.backend("grpc").serves_transport(wanted):
        from ..errors import ConfigurationError
        raise ConfigurationError(
            f"CommOptions(transport={wanted!r}) {where}, but the ring's links were set up for "
            f"transport {group.transport!r} when the job started", rank=group.rank,
            fix="choose the transport once per job: CommStrategy(transport=...), "
                "CommStrategy(communication_options=CommOptions(transport=...)), TFCS_TRANSPORT or "
                "tfcs-run --transport")

class CommCrossDeviceOps(cdo.CrossDeviceOps):
    """Cross-device ops of ``CommStrategy``; holds no state beyond a reference to the strategy's extended.

    Args:
      extended: the strategy's ``CommExtended`` (topology, default backend and options).
    """

    def __init__(self, extended):
        super().__init__()
        self._ext = extended

    # -- what TF asks ------------------------------------------------------------------------------
    @property
    def _num_between_graph_workers(self):
        return self._ext._num_workers

    def _options(self, options):
        merged = opts.merge(self._ext._communication_options, options)
        # the call's own transport first: merged into a plain TF default it would be dropped unseen
        wanted = getattr(options, "transport", None) or getattr(merged, "transport", None)
        if wanted is not None:
            check_transport(self._ext._group, wanted, "on one call")
        return merged

    def _backend_name(self, options) -> "opts.BackendChoice":
        return opts.BackendChoice(opts.choose_backend(options, self._ext._backend_name,
                                                      self._ext._communication_options),
                                  explicit=opts.backend_of(options) is not None)

    def _backend_for(self, choice: "opts.BackendChoice", tensors) -> Optional[str]:
        return choice.for_tensors(tensors, self._ext._group.default_backend)

    # -- reduce ------------------------------------------------------------------------------------
    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        """One value: ``batch_reduce_implementation`` with a batch of one.

        Args:
          reduce_op: ``tf.distribute.ReduceOp.SUM`` or ``MEAN``.
          per_replica_value: the value to reduce.
          destinations: where the result goes.
          options: this call's options, or None.

        Returns:
          The reduced value, mirrored on the destinations.
        """
        return self.batch_reduce_implementation(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options, local_only=False):
        """Reduce many values across every replica of every worker, in one fused collective.

        Args:
          reduce_op: ``tf.distribute.ReduceOp.SUM`` or ``MEAN``.
          value_destination_pairs: ``(PerReplica or tensor, destinations)`` pairs.
          options: this call's ``CommunicationOptions`` / ``CommOptions``, or None.
          local_only: reduce over this worker's replicas only (no collective).

        Returns:
          One ``Mirrored`` value (or ``IndexedSlices`` per device) for each pair, in order.

        Raises:
          CollectiveError: a subclass, from the collective (raised inside the numpy_function).
          UnsupportedOperationError: called inside an XLA-compiled function.
        """
        merged = self._options(options)
        backend = self._backend_name(options)
        workers = 1 if local_only else self._ext._num_workers

        def count(v):  # how many values a MEAN averages: this value's components on every worker (a plain
            return len(_values(v)) * workers  # tensor is one per worker, not one per replica)
        is_sparse = [isinstance(_values(v)[0], indexed_slices.IndexedSlices) for v, _ in value_destination_pairs]
        dense_idx = [i for i, sparse in enumerate(is_sparse) if not sparse]
        sparse_idx = [i for i, sparse in enumerate(is_sparse) if sparse]
        results: List = [None] * len(value_destination_pairs)

        local_sums = [self._local_sum(value_destination_pairs[i][0]) for i in dense_idx]
        if local_sums:
            mean = reduce_op == reduce_util.ReduceOp.MEAN
            divide = mean
            counts = [count(value_destination_pairs[i][0]) for i in dense_idx]
            if self._ext._num_workers > 1 and not local_only:
                # one value per worker: the collective's own MEAN divides by the world size (each rank
                # its own segment, before the all-gather), so no division op per tensor follows
                folded = mean and all(c == self._ext._num_workers for c in counts)
                reduced = self._cross_worker_reduce(local_sums, merged, backend, mean=folded,
                                                    compression=self._compression(options, merged))
                divide = mean and not folded
            else:
                reduced = local_sums
            for i, r, c in zip(dense_idx, reduced, counts):
                if divide:
                    r = self._divide(r, c)
                results[i] = self._to_destinations(r, value_destination_pairs[i][1])
        for i in sparse_idx:
            v, dest = value_destination_pairs[i]
            results[i] = self._reduce_sparse(reduce_op, v, dest, merged, backend, count(v), local_only)
        return results

    def _local_sum(self, value):
        parts = _values(value)
        with tf.device(parts[0].device):
            return parts[0] if len(parts) == 1 else tf.add_n(parts)

    def _compression(self, options, merged) -> str:
        """The call's compression: its own options' (a plain TF default merged over them drops it), the
        strategy's, else the job's (``TFCS_COMPRESSION``)."""
        return (opts.compression_of(options) or opts.compression_of(merged)
                or opts.compression_of(self._ext._communication_options) or self._ext._group.compression)

    def _cross_worker_reduce(self, tensors, merged, backend, mean: bool, compression: str = "none") -> List[tf.Tensor]:
        """All-reduce the tensors across workers in ONE numpy_function, one collective per fusion group
        (``fusion_groups``: one dtype, at most ``bytes_per_pack`` bytes), SUM, or MEAN when ``mean``.

        Each group is concatenated into a flat tensor in the graph, the numpy_function writes each result
        straight into the tensor it returns, and the results are split and reshaped back in the graph.
        A compressed call (``compression`` not "none") takes the backend's path, which narrows the
        float32 / float64 groups; the compiled all-reduce moves them as they are.
        """
        backend = self._backend_for(backend, tensors)
        timeout = opts.timeout_of(merged)
        native = self._ext._native
        if (native is not None and compression == "none" and backend in (None, "auto", "grpc")
                and native.handles(tensors)):  # host: grpc
            tensor_ops.check_not_xla("the all-reduce")
            return native.allreduce(tensors, mean, timeout)  # compiled: no numpy_function, concat or split
        groups = fusion_groups([t.dtype for t in tensors], [_static_nbytes(t) for t in tensors],
                               merged.bytes_per_pack)
        op = ReduceOp.MEAN if mean else ReduceOp.SUM
        flats = []
        for idxs in groups:
            with tf.device(tensors[idxs[0]].device):
                parts = [tf.reshape(tensors[i], [-1]) for i in idxs]
                flats.append(parts[0] if len(parts) == 1 else tf.concat(parts, axis=0))

        def call(b, arrs, outs=None):
            if outs is not None and b.capabilities.out_arrays:
                for a, o in zip(arrs, outs):  # straight into the arrays that become the returned tensors
                    b.allreduce(a, op, timeout, out=o, compression=compression)
                return outs
            reduced = [b.allreduce(a, op, timeout, compression=compression) for a in arrs]
            if outs is not None:
                for o, r in zip(outs, reduced):
                    o[...] = r
            return reduced

        reduced = tensor_ops.run_collective(call, backend, flats, [f.dtype for f in flats],
                                            [f.shape for f in flats], name="tfcs_batch_allreduce", into=True)
        out: List = [None] * len(tensors)
        for idxs, flat in zip(groups, reduced):
            with tf.device(tensors[idxs[0]].device):
                if len(idxs) == 1:
                    pieces = [flat]
                elif all(tensors[i].shape.is_fully_defined() for i in idxs):
                    pieces = tf.split(flat, [int(tensors[i].shape.num_elements()) for i in idxs])
                else:
                    pieces = tf.split(flat, tf.stack([tf.size(tensors[i]) for i in idxs]), num=len(idxs))
                for i, piece in zip(idxs, pieces):
                    t = tensors[i]
                    shape = t.shape if t.shape.is_fully_defined() else tf.shape(t)
                    out[i] = tf.reshape(piece, shape)
        return out

    @staticmethod
    def _divide(t, n):
        with tf.device(t.device):
            if t.dtype.is_integer:
                return tf.math.floordiv(t, tf.cast(n, t.dtype))
            return t / tf.cast(n, t.dtype)

    @staticmethod
    def _to_destinations(t, destinations):
        devices = cdo.get_devices_from(destinations)
        copies = []
        for d in devices:
            with tf.device(d):
                copies.append(tf.identity(t))
        return distribute_utils.regroup(copies, wrap_class=value_lib.Mirrored)

    def _reduce_sparse(self, reduce_op, value, destinations, merged, backend, n_global, local_only):
        parts = _values(value)
        with tf.device(parts[0].device):
            vals = tf.concat([p.values for p in parts], axis=0)
            idxs = tf.concat([tf.cast(p.indices, tf.int64) for p in parts], axis=0)
        if self._ext._num_workers > 1 and not local_only:
            vals, idxs = self._allgather_many([vals, idxs], merged, backend)
        if reduce_op == reduce_util.ReduceOp.MEAN:
            vals = self._divide(vals, n_global)
        idxs = tf.cast(idxs, parts[0].indices.dtype)
        devices = cdo.get_devices_from(destinations)
        out = []
        for d in devices:
            with tf.device(d):
                out.append(indexed_slices.IndexedSlices(tf.identity(vals), tf.identity(idxs),
                                                        parts[0].dense_shape))
        return distribute_utils.regroup(out, wrap_class=value_lib.Mirrored)

    def _allgather_many(self, tensors, merged, backend, axis=0):
        backend = self._backend_for(backend, tensors)
        timeout = opts.timeout_of(merged)

        def call(b, arrs):
            res = []
            for a in arrs:
                wrap = type(a) if getattr(type(a), "__tfcs_device_buffer__", False) else None  # Bfloat16Array
                a = a.data if wrap else a
                xp = _array_module(a)
                moved = xp.ascontiguousarray(xp.moveaxis(a, axis, 0) if a.ndim and axis else a)
                g = b.allgather(wrap(moved) if wrap else moved, timeout)
                g = g.data if wrap else g
                g = xp.ascontiguousarray(xp.moveaxis(g, 0, axis)) if a.ndim and axis else g
                res.append(wrap(g) if wrap else g)
            return res

        shapes = []
        for t in tensors:
            s = t.shape.as_list() if t.shape.rank is not None else None
            if s is not None and s:
                s[axis] = None
            shapes.append(tf.TensorShape(s))
        return tensor_ops.run_collective(call, backend, tensors, [t.dtype for t in tensors], shapes,
                                         name="tfcs_allgather")

    # -- gather / broadcast ------------------------------------------------------------------------
    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        parts = _values(per_replica_value)
        with tf.device(parts[0].device):
            local = parts[0] if len(parts) == 1 else tf.concat(parts, axis=axis)
        if self._ext._num_workers > 1:
            merged = self._options(options)
            local, = self._allgather_many([local], merged, self._backend_name(options), axis=axis)
        return self._to_destinations(local, destinations)

    def broadcast_implementation(self, tensor, destinations):
        """Copy ``tensor`` to the destination devices of this worker (no collective).

        Args:
          tensor: the value (already equal on every worker).
          destinations: this worker's destination devices.

        Returns:
          A ``Mirrored`` value.
        """
        # Within a worker only: values are already identical across workers (variables are
        # initialized from rank 0 and updated with all-reduced gradients).
        return cdo.simple_broadcast(tensor, destinations, always_mirrored=True,
                                    canonicalize_devices=self._canonicalize_devices)

    def _all_reduce(self, reduce_op, value, replica_id, options):  # pragma: no cover - merge_call is used
        raise NotImplementedError("CommStrategy reduces through merge_call (batch_reduce)")
