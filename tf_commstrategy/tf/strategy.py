"""``CommStrategy``: MirroredStrategy's in-worker machinery, our collectives between workers.

One replica per local device per worker; ``num_replicas_in_sync`` is the global count. It subclasses
``tf.distribute.MirroredStrategy`` (and ``MirroredExtended``) but is deliberately *not* a
``MultiWorkerMirroredStrategy``: tf_keras would then sum per-batch logs across workers.

What differs from MirroredStrategy, and why:

* replica ids, ``num_replicas_in_sync``, multi-worker mode, chief-only checkpoints/summaries: global;
* datasets: each worker reads its shard (an ``InputContext`` per worker, as MWMS does); a worker with
  one CPU replica reads it through a plain ``tf.data`` iterator (``input_path``);
* initial values: variables created under the scope take rank 0's value (a broadcast), optimizer
  slots included, so no callback is needed for identical starting points;
* every reduction, including int32 ones and CPU destinations that MirroredStrategy sends elsewhere,
  goes through ``CommCrossDeviceOps`` so it crosses workers;
* ``sync_metrics=False`` reduces metric variables (SyncOnRead) over local replicas only.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional, Sequence

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cdo
from tensorflow.python.distribute import (distribute_lib, distribute_utils, input_util, mirrored_strategy,
                                             reduce_util, values_util)
from tensorflow.python.distribute import values as value_lib
from tensorflow.python.distribute.cluster_resolver import SimpleClusterResolver
from tensorflow.python.training import server_lib
from tensorflow.python.trackable import base as trackable_base

from .. import heap as heap_policy
from .. import process
from ..core.backend import normalize_backend_name
from . import input_path, keras3_compat, tensor_ops, tf_keras_compat, threads
from .keras_patches import TF_SAVING
from . import options as opts
from .cross_device_ops import CommCrossDeviceOps, check_transport
from .native_path import NativeAllReduce



_local_reads = 0  # > 0 inside local_replica_reads(): every replica-local read stays on this worker


@contextlib.contextmanager
def local_replica_reads():
    """Inside the block every read of a replica-local (SyncOnRead) variable gives this worker's own
    value, without a collective, under every CommStrategy of the process.

    ``tf_keras_compat`` and ``keras3_compat`` wrap every way of saving a model in it (``Model.save`` /
    ``save_weights``, ``save_model``, ``tf.saved_model.save``), so ``if tfcs.rank() == 0: save(...)``
    saves the metrics' state (totals, counts) of rank 0 alone and never issues a collective that the
    other ranks would not join."""
    global _local_reads
    _local_reads += 1
    try:
        yield
    finally:
        _local_reads -= 1


def install_keras_patches() -> None:
    """Teach TensorFlow's SavedModel writer, tf_keras and Keras 3 about tf_commstrategy (idempotent).

    ``CommStrategy()`` calls it, and so does the Horovod API's ``init``: besides what only a
    ``CommStrategy`` model uses, it makes ``fit`` / ``evaluate`` / ``predict`` raise a collective's typed
    error where TensorFlow would report it as ``tf.errors.UnknownError``.

    Raises:
      ConfigurationError: an installed Keras is not a version these patches were written for.
    """
    TF_SAVING.install()
    tf_keras_compat.install()
    keras3_compat.install()


class CommStrategy(tf.distribute.MirroredStrategy):
    """Synchronous data parallelism across workers; ``model.fit`` works unchanged.

    Args:
      devices: this worker's devices (default: all local GPUs, else the CPU).
      backend: default backend, "grpc" | "nccl" | "auto" (default: ``TFCS_BACKEND``, else "auto").
      communication_options: a ``tf.distribute.experimental.CommunicationOptions`` or ``CommOptions``
        used when a call brings none (RING -> grpc, NCCL -> nccl; timeout_seconds, bytes_per_pack).
      sync_metrics: True (default): metrics are global, reduced across workers when read. False: metrics
        stay local per worker (faster); average epoch logs with ``callbacks.MetricAverageCallback``.
      timeout: collective deadline in seconds (default ``TFCS_TIMEOUT`` or 300).
      tf_threads: TensorFlow's intra-/inter-op pool size: "auto" (default, ``TFCS_TF_THREADS``): when
        several workers share a host, each gets its share of the cores (``cores // local_size``);
        "off": TensorFlow's own sizes (every core, in every worker); or a number per pool. Applied
        only if no TensorFlow op ran before the strategy was built (see ``tf/threads.py``).
      heap: "auto" (default, ``TFCS_HEAP``): glibc keeps the memory a training step frees for the next
        step instead of returning it to the kernel and faulting it back in (see ``heap.py``); "off":
        glibc's own thresholds. Left alone when ``MALLOC_*_`` variables or another allocator are set.
      compression: "none" | "fp16" | "bf16": float32 / float64 gradients travel as float16 / bfloat16,
        half the bytes, rounded at every ring step (default: ``communication_options``' own, else the
        job's, ``TFCS_COMPRESSION``); a call's ``CommOptions(compression=...)`` overrides it. See docs/api.md.
      **init_kwargs: passed to ``tf_commstrategy.init`` when the process group is not yet initialized.

    Raises:
      ConfigurationError: an invalid ``tf_threads`` or ``heap``; or from ``tf_commstrategy.init``.
      RendezvousError: from ``tf_commstrategy.init``.
    """

    def __init__(self, devices: Optional[Sequence[str]] = None, backend: Optional[str] = None,
                 communication_options=None, sync_metrics: bool = True, timeout: Optional[float] = None,
                 tf_threads=None, heap=None, compression: Optional[str] = None, **init_kwargs):
        wanted = init_kwargs.get("transport") or getattr(communication_options, "transport", None)
        if process.is_initialized() and set(init_kwargs) <= {"transport"}:
            # joined already (tfcs.init with whatever settings): timeout= is this strategy's deadline, and
            # a transport must be one the job's links serve
            group = process.default_group()
            if wanted is not None:
                check_transport(group, wanted, "given to CommStrategy after tfcs.init()")
            if timeout is not None:
                communication_options = _with_timeout(communication_options, timeout)
        else:
            if wanted is not None:
                init_kwargs["transport"] = wanted  # the ring's data path is chosen when the job starts
            group = process.init(timeout=timeout, **init_kwargs)
        if compression is not None:
            communication_options = opts.with_compression(communication_options, compression)
        self._thread_plan = threads.configure(tf_threads, group.local_size, group.rank)  # before TF starts
        self._heap_plan = heap_policy.configure(heap, group.rank)
        extended = CommExtended(self, devices, group, normalize_backend_name(backend), communication_options,
                                sync_metrics)
        distribute_lib.Strategy.__init__(self, extended)
        install_keras_patches()

    @property
    def process_group(self):
        """The process group this strategy's collectives run in (the one ``tfcs.init`` made)."""
        return self.extended._group


def _with_timeout(options, timeout: float):
    """The strategy's default options with ``timeout`` as their deadline (``timeout=`` is an explicit
    argument: it beats the ``timeout_seconds`` of ``communication_options``)."""
    from .. import config
    value = config.call_timeout(timeout, 0.0)  # a number > 0, or ConfigurationError
    if options is None:
        return opts.CommOptions(timeout_seconds=value)
    options = copy.deepcopy(options)
    options.timeout_seconds = value
    return options


class CommExtended(mirrored_strategy.MirroredExtended):
    """The strategy's implementation (``strategy.extended``); see the module docstring for what it changes.

    Args:
      container: the ``CommStrategy``.
      devices: this worker's devices (None: all local GPUs, else the CPU).
      group: the process group.
      backend: the strategy's default backend name, or None.
      communication_options: the strategy's default options, or None.
      sync_metrics: whether metric variables are reduced across workers when read.
    """

    def __init__(self, container, devices, group, backend, communication_options, sync_metrics):
        self._group = group
        self._backend_name = backend
        self._sync_metrics = bool(sync_metrics)
        self._num_workers = group.size
        self._id_in_cluster = group.rank
        self._task_type = "worker"
        self._task_id = group.rank
        self._is_chief = group.rank == 0
        self._cluster_resolver = SimpleClusterResolver(
            server_lib.ClusterSpec({"worker": [f"rank{i}:0" for i in range(group.size)]}),
            task_type="worker", task_id=group.rank, rpc_layer="tfcs")
        super().__init__(container, devices=devices, cross_device_ops=CommCrossDeviceOps(self))
        # the host all-reduce as a compiled op when every rank shares this host's memory (a collective
        # step, taken by the first CommStrategy of the group; None where it cannot run)
        self._native = NativeAllReduce.for_group(group)
        # MirroredExtended set NCCL options as its default; ours are the user's (or none)
        self._communication_options = communication_options

    # -- topology ----------------------------------------------------------------------------------
    @property
    def _num_replicas_in_sync(self):
        return len(self._devices) * self._num_workers

    def _get_replica_id_in_sync_group(self, replica_id):
        return self._id_in_cluster * len(self._devices) + replica_id

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group - self._id_in_cluster * len(self._devices)

    def _in_multi_worker_mode(self):
        return self._num_workers > 1

    @property
    def experimental_between_graph(self):
        return True

    @property
    def should_checkpoint(self):
        return self._is_chief

    @property
    def should_save_summary(self):
        return self._is_chief

    def _use_merge_call(self):
        return True

    def _get_cross_device_ops(self, value):
        return self._cross_device_ops

    # -- input -------------------------------------------------------------------------------------
    def _make_input_context(self):
        return distribute_lib.InputContext(num_input_pipelines=self._num_workers,
                                           input_pipeline_id=self._id_in_cluster,
                                           num_replicas_in_sync=self._num_replicas_in_sync)

    def _experimental_distribute_dataset(self, dataset, options):
        if options and options.experimental_replication_mode == distribute_lib.InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is not supported by CommStrategy")
        options = input_path.options_for(self._devices, options)
        return input_util.get_distributed_dataset(
            dataset, self._input_workers_with_options(options), self._container_strategy(),
            num_replicas_in_sync=self._num_replicas_in_sync, input_context=self._make_input_context(),
            options=options)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if options and options.experimental_replication_mode == distribute_lib.InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is not supported by CommStrategy")
        options = input_path.options_for(self._devices, options)
        return input_util.get_distributed_datasets_from_function(
            dataset_fn=dataset_fn, input_workers=self._input_workers_with_options(options),
            input_contexts=[self._make_input_context()], strategy=self._container_strategy(), options=options)

    def _experimental_distribute_values_from_function(self, value_fn):
        per_replica = []
        for local_id in range(len(self._devices)):
            replica_id = self._id_in_cluster * len(self._devices) + local_id
            per_replica.append(value_fn(distribute_lib.ValueContext(replica_id, self._num_replicas_in_sync)))
        return distribute_utils.regroup(per_replica, always_wrap=True)

    # -- variables: rank 0's initial values everywhere -----------------------------------------------
    def _get_variable_creator_initial_value(self, replica_id, device, primary_var, **kwargs):
        if replica_id != 0 or self._num_workers == 1:
            return super()._get_variable_creator_initial_value(replica_id, device, primary_var, **kwargs)
        initial_value = kwargs["initial_value"]
        dtype = kwargs.get("dtype", None)

        def initial_value_fn():
            with tf.device(device):
                value = initial_value() if callable(initial_value) else initial_value
                if isinstance(value, trackable_base.CheckpointInitialValue):
                    value = value.wrapped_value
                value = tf.convert_to_tensor(value, dtype=dtype)
                if not _broadcastable(value.dtype):
                    return value
                # the strategy's backend and deadline, chosen as for its other collectives
                ops_ = self._cross_device_ops
                backend = ops_._backend_for(ops_._backend_name(None), [value])
                timeout = opts.timeout_of(ops_._options(None))
                return tf.identity(tensor_ops.broadcast(value, 0, backend=backend, timeout=timeout))
        return initial_value_fn

    # -- metric reads: one fused reduction for all of them -------------------------------------------
    @contextlib.contextmanager
    def fused_sync_on_read(self, variables):
        """Inside the block, cross-worker reads of these replica-local (SyncOnRead) variables are served
        from ONE fused reduction made on entry, instead of one collective per variable.

        tf_keras reads every metric's state (e.g. total and count of each ``Mean``) at every step;
        ``tf_keras_compat`` and ``keras3_compat`` wrap ``Model.get_metrics_result`` in this block. Works in replica context
        (the reduction runs in a ``merge_call``, as each read would) and in cross-replica context.
        Nothing changes the variables inside the block, and the served values belong to the graph
        (or eager context) the block was entered in.

        Args:
          variables: candidate variables; those whose reads stay local, or that are not SUM / MEAN
            aggregated SyncOnRead variables, are read as usual.
        """
        todo = {}
        if self._num_workers > 1:
            for v in variables:
                if (isinstance(v, value_lib.SyncOnReadVariable) and v.aggregation in _FUSED_READ_AGGREGATIONS
                        and not self._replica_local_read_is_local(v)):
                    todo.setdefault(v.aggregation, []).append(v)
        if sum(len(vs) for vs in todo.values()) < 2 or self._all_cached(todo):
            try:
                yield  # (served by the piggyback on the gradients' all-reduce, when there was one)
            finally:
                self._read_cache = None
            return

        def prefetch(strategy, groups):
            cache = {}
            for aggregation, vs in groups.items():
                op = reduce_util.ReduceOp.from_variable_aggregation(aggregation)
                reduced = strategy.extended.batch_reduce_to(op, [(v, v) for v in vs])
                for v, r in zip(vs, reduced):
                    cache[id(v)] = (v, op, r)
            self._read_cache = (_graph_key(), cache)

        strategy = self._container_strategy()
        # outside any scope TF's default replica context is current, whose merge_call reduces nothing;
        # the reads themselves enter this strategy (DistributedVariable._get), so the prefetch does too
        with distribute_lib.enter_or_assert_strategy(strategy):
            ctx = distribute_lib.get_replica_context()
            if ctx is not None:
                ctx.merge_call(prefetch, args=(todo,))
            else:
                prefetch(strategy, todo)
        try:
            yield
        finally:
            self._read_cache = None

    def _all_cached(self, todo) -> bool:
        cache = getattr(self, "_read_cache", None)
        if cache is None or cache[0] != _graph_key():
            return False
        return all(id(v) in cache[1] and cache[1][id(v)][0] is v for vs in todo.values() for v in vs)

    @contextlib.contextmanager
    def piggyback_reads(self, variables):
        """Inside the block, the next SUM ``batch_reduce_to`` (the gradients' all-reduce, in tf_keras's
        ``apply_gradients``) also reduces these SUM-aggregated replica-local variables (metric state),
        and ``fused_sync_on_read`` then serves their reads from it: one collective per train step.

        The variables must not change between that reduction and their reads (``tf_keras_compat``
        updates the metrics before the optimizer step, then reads them after). If no such reduction
        happens in the block, the reads make their own fused one as before.

        Args:
          variables: candidate variables (others are ignored).
        """
        todo = [v for v in variables if isinstance(v, value_lib.SyncOnReadVariable)
                and v.aggregation == tf.VariableAggregation.SUM and not self._replica_local_read_is_local(v)]
        if self._num_workers <= 1 or not todo:
            yield
            return
        self._piggyback = (_graph_key(), todo)
        try:
            yield
        finally:
            self._piggyback = None

    def _cached_read(self, reduce_op, value):
        cache = getattr(self, "_read_cache", None)
        if cache is None or cache[0] != _graph_key():
            return None
        hit = cache[1].get(id(value))
        if hit is None or hit[0] is not value or hit[1] != reduce_op:
            return None
        return hit[2]

    # -- reductions --------------------------------------------------------------------------------
    def _reduce_to(self, reduce_op, value, destinations, options):
        if not isinstance(value, (value_lib.DistributedValues, tf.Tensor, tf.Variable)) and tf.nest.is_nested(value):
            # a structure (strategy.reduce of a batch): each leaf, as MirroredStrategy does
            return tf.nest.map_structure(lambda v: self._reduce_to(reduce_op, v, destinations, options), value)
        if isinstance(value, value_lib.Mirrored) and reduce_op == reduce_util.ReduceOp.MEAN:
            return value
        cached = self._cached_read(reduce_op, value) if isinstance(value, value_lib.SyncOnReadVariable) else None
        if cached is not None:
            return cached
        local_only = isinstance(value, value_lib.SyncOnReadVariable) and self._replica_local_read_is_local(value)
        if not isinstance(value, value_lib.DistributedValues) and self._num_workers == 1:
            return cdo.reduce_non_distributed_value(reduce_op, value, destinations, len(self._devices))
        if isinstance(value, value_lib.DistributedValues):
            per_replica = value
        else:
            per_replica = cdo._make_tensor_into_per_replica(value)  # pylint: disable=protected-access
        if destinations is None:
            destinations = per_replica
        return self._cross_device_ops.batch_reduce_implementation(
            reduce_op, [(per_replica, destinations)], options, local_only=local_only)[0]

    def _replica_local_read_is_local(self, var) -> bool:
        """Which reads of replica-local (SyncOnRead) variables stay on this worker.

        * SUM-aggregated ones are metric state (totals, counts). tf_keras reads them on every rank,
          in the train/test step and at epoch end, so they are reduced across workers, unless
          ``sync_metrics=False`` asked for local metrics.
        * MEAN-aggregated ones are BatchNormalization moving statistics. Inside a tf.function (which
          every rank runs) they are averaged across workers; read eagerly, e.g. by ``model.save()`` or
          ``get_weights()`` on rank 0 alone, they give this worker's average without a collective, so
          ``if tfcs.rank() == 0: model.save(path)`` works and never hangs. Their values may then differ
          between workers, as they do under Horovod (each worker's statistics come from its own batches).
        """
        if _local_reads or values_util.is_saving_non_distributed():
            return True
        if var.aggregation == tf.VariableAggregation.MEAN:
            return tf.executing_eagerly()
        return not self._sync_metrics

    @contextlib.contextmanager
    def local_replica_reads(self):
        """The module's ``local_replica_reads`` (every CommStrategy's reads), kept as a method too."""
        with local_replica_reads():
            yield

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        pairs = []
        for v, d in value_destination_pairs:
            if not isinstance(v, value_lib.DistributedValues):
                v = cdo._make_tensor_into_per_replica(v)  # pylint: disable=protected-access
            pairs.append((v, d if d is not None else v))
        ride = getattr(self, "_piggyback", None)
        if ride is None or ride[0] != _graph_key() or reduce_op != reduce_util.ReduceOp.SUM:
            return self._cross_device_ops.batch_reduce_implementation(reduce_op, pairs, options)
        self._piggyback = None  # metric state rides on this reduction (see piggyback_reads)
        extra = ride[1]
        results = self._cross_device_ops.batch_reduce_implementation(reduce_op, pairs + [(v, v) for v in extra],
                                                                     options)
        self._read_cache = (ride[0], {id(v): (v, reduce_op, r) for v, r in zip(extra, results[len(pairs):])})
        return results[:len(pairs)]

    def _gather_to_implementation(self, value, destinations, axis, options):
        if not isinstance(value, value_lib.DistributedValues):
            value = cdo._make_tensor_into_per_replica(value)  # pylint: disable=protected-access
        return self._cross_device_ops._gather_implementation(value, destinations, axis, options)

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # Always through merge_call -> batch_reduce_to (our fused cross-worker path).
        return distribute_lib.StrategyExtendedV2._replica_ctx_all_reduce(self, reduce_op, value, options)


_FUSED_READ_AGGREGATIONS = (tf.VariableAggregation.SUM, tf.VariableAggregation.MEAN)


def _graph_key():
    """The graph reads happen in (None when eager), to keep cached reads from leaking across graphs."""
    return None if tf.executing_eagerly() else id(tf.compat.v1.get_default_graph())


def _broadcastable(dtype: tf.DType) -> bool:
    return dtype in (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int8, tf.uint8, tf.int32,
                     tf.int64, tf.bool)
