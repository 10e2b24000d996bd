"""GPU tensors to the nccl backend without host copies: TF <-> cupy through DLPack.

When a call's backend is nccl (chosen, or "auto" with tensors on a GPU where nccl can run), the
collective runs in a stateful ``tf.py_function`` placed on the tensors' GPU, so TF hands the Python
body GPU tensors; each is exported with ``tf.experimental.dlpack.to_dlpack`` and imported with
``cupy.from_dlpack`` (zero copy), and the results travel back the same way.

Stream ordering, exactly:

* producers -> collective: TF's DLPack export carries no stream, and TF does not expose its compute
  stream to Python. So before exporting, the body synchronises the tensors' GPU (``SyncDevice``, the
  op behind ``tf.test.experimental.sync_devices``): everything TF queued that produces the inputs
  has finished. The collective is then queued on cupy's current stream.
* collective -> consumers: the backend returns only after the collective has completed on the GPU
  (``Communicator.wait``), so the memory TF imports holds final values before any TF op reads it.

bfloat16 tensors are bit-cast to uint16 (``tf.bitcast``, no copy) and travel as ``Bfloat16Array``;
bool tensors are cast to uint8 (a small device copy) and back.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import tensorflow as tf

from ..core.backend import normalize_backend_name
from ..errors import UnsupportedOperationError
from ..process import default_group


def on_gpu(t) -> bool:
    """True when the tensor's device type is GPU (unknown placement counts as not)."""
    from ..core.device_arrays import device_type
    return device_type(getattr(t, "device", "") or "") == "GPU"


def use_device_path(backend: Optional[str], tensors: Sequence) -> bool:
    """Whether a call with ``backend`` on ``tensors`` runs on the GPU through nccl.

    Args:
      backend: the call's backend name (None: the group's default).
      tensors: the call's tensors.

    Returns:
      True for nccl on GPU tensors; False for the host path (grpc).

    Raises:
      BackendUnavailableError: nccl was chosen but cannot run here (no cupy / NCCL / GPU).
      UnsupportedOperationError: nccl was chosen for tensors on the CPU.
    """
    g = default_group()
    name = normalize_backend_name(backend) or g.default_backend
    gpu = bool(tensors) and all(on_gpu(t) for t in tensors)
    if name == "nccl":
        g.backend("nccl")  # BackendUnavailableError, with the reason, where nccl cannot run
        if not gpu:
            where = sorted({getattr(t, "device", "") or "an unplaced (CPU) device" for t in tensors})
            raise UnsupportedOperationError(
                f"the nccl backend moves GPU tensors, but got tensors on {where}", rank=g.rank,
                fix="place the tensors on a GPU (with tf.device('/GPU:0')), or use backend='grpc' / "
                    "CommunicationOptions(implementation=RING), or 'auto' (CPU tensors go to grpc)")
        return True
    if name == "auto" and gpu:
        from ..core.auto import choose
        return choose(g, tensors[0]) == "nccl"
    return False


def _sync(device: str) -> None:
    from tensorflow.python.ops import gen_sync_ops
    with tf.device(device):
        gen_sync_ops.sync_device()


def to_cupy(t):
    """A GPU tensor as a cupy array (or ``Bfloat16Array``) sharing its memory (bool: a uint8 copy)."""
    import cupy
    from ..core.device_arrays import Bfloat16Array
    if t.dtype == tf.bfloat16:
        return Bfloat16Array(cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(tf.bitcast(t, tf.uint16))))
    if t.dtype == tf.bool:
        t = tf.cast(t, tf.uint8)
    return cupy.from_dlpack(tf.experimental.dlpack.to_dlpack(t))


def from_cupy(x, dtype: tf.DType):
    """A cupy array (or ``Bfloat16Array``) as a GPU tensor of ``dtype``, without a copy (bool: a cast)."""
    from ..core.device_arrays import Bfloat16Array
    if isinstance(x, Bfloat16Array):
        return tf.bitcast(tf.experimental.dlpack.from_dlpack(x.data.toDlpack()), tf.bfloat16)
    t = tf.experimental.dlpack.from_dlpack(x.toDlpack())
    return tf.cast(t, tf.bool) if dtype == tf.bool else t


def run_device(fn: Callable[[List], List], tensors: Sequence[tf.Tensor], out_dtypes: Sequence[tf.DType],
               out_shapes: Sequence, name: str = "tfcs_nccl_collective") -> List[tf.Tensor]:
    """Run ``fn`` on the tensors as cupy arrays, eagerly or as one stateful py_function on their GPU.

    Args:
      fn: ``fn(list of cupy arrays / Bfloat16Array) -> list of the same``; runs the collectives.
      tensors: its inputs, all on one GPU.
      out_dtypes: the dtypes of its outputs.
      out_shapes: the static shapes to set on the outputs.
      name: the op's name in the graph.

    Returns:
      A list of GPU tensors, one per output.
    """
    from .tensor_ops import check_not_xla, errors_seen
    from ..errors import TfcsError
    check_not_xla(name)
    device = tensors[0].device

    def body(*ts):
        _sync(device)
        outs = fn([to_cupy(t) for t in ts])
        return [from_cupy(o, d) for o, d in zip(outs, out_dtypes)]

    if tf.executing_eagerly():
        return body(*tensors)

    def graph_body(*ts):
        try:
            return body(*ts)
        except TfcsError as e:
            errors_seen.record(e)
            raise

    with tf.device(device):
        outs = tf.py_function(graph_body, list(tensors), list(out_dtypes), name=name)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for o, s in zip(outs, out_shapes):
        o.set_shape(s)
    return list(outs)
