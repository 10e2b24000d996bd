"""Keras callbacks: broadcast of initial state, metric averaging, learning-rate warmup, rank-0 logging."""

from .keras_callbacks import (BroadcastGlobalVariablesCallback, LearningRateWarmupCallback, MetricAverageCallback,
                              verbosity)

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback", "verbosity"]
