"""Gradient compression as Horovod defines it: ``Compression.none`` and ``Compression.fp16``.

A compressor turns a tensor into what travels (``compress(tensor) -> (tensor, ctx)``) and back
(``decompress(tensor, ctx)``); the collective runs on the compressed tensor. ``fp16`` halves the bytes
of float32 / float64 gradients at the price of float16's precision and range (values beyond 65504
overflow); tensors that are not floating point pass unchanged.

The all-reduces hand the built-in compressors to the core's compression instead (``wire``): a float16
tensor cast in the graph would still travel as float32 partial sums through the ring's reduce-scatter,
which the core keeps for the accuracy of float16 data; compressed, the partial sums travel as float16
too. Reduce-scatter (and a compressor of the user's own) casts in the graph as above.
"""

from __future__ import annotations

import tensorflow as tf


class Compressor:
    """Interface for compressing and decompressing a given tensor.

    Attributes:
      wire: the core's compression that does this compressor's work inside an all-reduce ("fp16"), or
        None: ``compress`` / ``decompress`` run around the collective (in the job's compression).
    """

    wire = None

    @staticmethod
    def compress(tensor):
        """Compress ``tensor``; returns it with the context needed to decompress it."""

    @staticmethod
    def decompress(tensor, ctx):
        """Decompress ``tensor`` with the context ``compress`` returned."""


class NoneCompressor(Compressor):
    """The default: no compression (the job's own, ``TFCS_COMPRESSION``, still applies)."""

    @staticmethod
    def compress(tensor):
        """Returns the tensor unmodified, and no context."""
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        """Returns the tensor unmodified."""
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own dtype."""

    wire = "fp16"

    @staticmethod
    def compress(tensor):
        """Casts a floating-point tensor to float16; the context is the original dtype."""
        compressed = tensor
        if tensor.dtype.is_floating:
            compressed = tf.cast(tensor, dtype=tf.float16)
        return compressed, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        """Casts back to the dtype ``compress`` saw (``ctx``) when that was floating point."""
        dtype = ctx
        if dtype.is_floating:
            return tf.cast(tensor, dtype=dtype)
        return tensor


class Compression:
    """The compression algorithms an all-reduce or reduce-scatter takes (``compression=``).

    Attributes:
      none: no compression (the default).
      fp16: floating-point tensors travel as float16.
    """

    none = NoneCompressor
    fp16 = FP16Compressor
