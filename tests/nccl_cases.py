"""Inputs and numpy references for the nccl backend's every-op x every-dtype checks, shared by the fake-GPU
tests (tests/multiprocess) and the real-GPU ones (tests/gpu). No TensorFlow, no cupy."""

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = ["float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]
OPS = ["sum", "mean", "min", "max", "prod"]
SHAPE = (5, 3)


def _pairs():
    for d in DTYPES:
        for op in OPS:
            if d == "bool" and op not in ("min", "max"):
                continue
            yield d, op


def make_input(rank, dtype, op, seed=7, shape=None):
    shape = SHAPE if shape is None else shape
    rng = np.random.default_rng([seed, rank, DTYPES.index(dtype), OPS.index(op)])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    if op == "prod":
        if np.issubdtype(dt, np.integer):
            return rng.choice(np.array([1, 1, 2, 1]), shape).astype(dt)
        return rng.uniform(0.8, 1.25, shape).astype(dt)
    if np.issubdtype(dt, np.integer):
        hi = 20 if dt.itemsize == 1 else 1000
        lo = 0 if np.issubdtype(dt, np.unsignedinteger) else -hi
        return rng.integers(lo, hi, shape).astype(dt)
    return rng.standard_normal(shape).astype(dt)


def reference(inputs, op, dtype):
    dt = inputs[0].dtype
    wide = np.float32 if dtype in ("float16", "bfloat16") else dt
    stack = np.stack([x.astype(wide) for x in inputs])
    if op in ("sum", "mean"):
        r = stack.sum(0)
        if op == "mean":
            n = len(inputs)
            r = (r // n) if np.issubdtype(dt, np.integer) else (r.astype(dt).astype(np.float32) / n
                                                               if dtype in ("float16", "bfloat16") else r / n)
    elif op == "prod":
        r = stack.prod(0)
    elif op == "min":
        r = stack.min(0)
    else:
        r = stack.max(0)
    return np.asarray(r).astype(dt)


def to_device(cupy, x):
    """A host array as the nccl backend's input: a cupy array, bfloat16 as ``Bfloat16Array``."""
    from tf_commstrategy.backends.nccl import Bfloat16Array
    if x.dtype == BF16:
        return Bfloat16Array(cupy.asarray(x.view(np.uint16)))
    return cupy.asarray(x)


def to_host(y):
    """(numpy copy of a result, its type as "module.Class") for the nccl backend's outputs."""
    if type(y).__name__ == "Bfloat16Array":
        return y.data.get().view(np.uint16).view(BF16), "Bfloat16Array"
    return y.get(), f"{type(y).__module__.split('.')[0]}.{type(y).__name__}"
