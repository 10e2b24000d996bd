"""What the two Keras flavours' patch modules share: declared patches, version guards, step agreement.

``tf_keras_compat`` teaches tf_keras (Keras 2) about ``CommStrategy`` and ``keras3_compat`` teaches
Keras 3 (``import keras``, and ``tf.keras`` on TensorFlow 2.16+). Each patches private Keras internals;
each declares its patches as a table of ``"module:Class.attribute"`` symbols (``Patches``) so that a test
can check every patched symbol still exists, and each is guarded by the Keras versions it was written
for: on another version it refuses to patch and says which version it found and which it needs.

The flavour that applies is decided by the model: both modules patch their own Keras's classes, and
each wrapper acts only for models (or optimizers, callbacks) under a ``CommStrategy``, so a tf_keras
model and a Keras 3 model can live in one process.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import sys
from typing import Callable, Dict, Optional, Tuple

_warned_uneven = False

Version = Tuple[int, int]


def parse_version(text: str) -> Version:
    """``"3.15.1"`` -> ``(3, 15)``; unparsable parts count as 0."""
    parts = re.findall(r"\d+", text or "")[:2]
    return tuple(int(p) for p in parts + ["0"] * (2 - len(parts)))  # type: ignore[return-value]


def resolve(symbol: str):
    """``"pkg.module:Class.attr"`` -> ``(owner, "attr")``: the object that holds the attribute.

    Raises:
      ImportError / AttributeError: the module, or an owner on the path, does not exist.
    """
    module_name, _, path = symbol.partition(":")
    owner = importlib.import_module(module_name)
    *owners, name = path.split(".")
    for part in owners:
        owner = getattr(owner, part)
    if not hasattr(owner, name):
        raise AttributeError(f"{symbol}: {owner!r} has no attribute {name!r}")
    return owner, name


def wrap_once(owner, name: str, build: Callable) -> None:
    """Replace ``owner.name`` by ``build(original)``, once: a wrapper already in place (a second
    ``install``) is left alone. The wrapper keeps the original's name and docstring, and the original
    stays reachable as its ``__wrapped__``."""
    original = getattr(owner, name)
    if getattr(original, "_tfcs_wrapper", False):
        return
    wrapper = functools.wraps(original, updated=())(build(original))
    wrapper._tfcs_wrapper = True
    setattr(owner, name, wrapper)


class Patches:
    """The patches of one Keras flavour.

    Args:
      flavour: what the user knows it as ("Keras 3", "tf_keras").
      package: the importable package whose ``__version__`` is checked.
      supported: ``(lowest, first unsupported)`` versions as ``(major, minor)``.
      table: ``{"module:Class.attr": build}``; each ``build(original)`` returns the wrapper.
    """

    def __init__(self, flavour: str, package: str, supported: Tuple[Version, Version],
                 table: Dict[str, Callable]):
        self.flavour = flavour
        self.package = package
        self.supported = supported
        self.table = table
        self.installed = False

    def version(self) -> Optional[str]:
        """The installed version of the package, or None when it is not installed."""
        try:
            module = importlib.import_module(self.package)
        except ImportError:
            return None
        return getattr(module, "__version__", "0")

    def check_version(self, version: str) -> None:
        """Raise ``ConfigurationError`` unless ``version`` is one the patches were written for."""
        low, high = self.supported
        if not low <= parse_version(version) < high:
            from ..errors import ConfigurationError
            raise ConfigurationError(
                f"CommStrategy's {self.flavour} support was written for {self.package} "
                f"{low[0]}.{low[1]} up to (not including) {high[0]}.{high[1]}, and {self.package} "
                f"{version} is installed: its private training internals may differ",
                fix=f"install a supported version (pip install '{self.package}>={low[0]}.{low[1]},"
                    f"<{high[0]}.{high[1]}'), the pins of tf_commstrategy's pyproject.toml")

    def install(self) -> bool:
        """Apply every patch of the table (idempotent). Returns False when the package is not
        installed (nothing to teach).

        Raises:
          ConfigurationError: the installed version is not one the patches were written for.
        """
        if self.installed:
            return True
        version = self.version()
        if version is None:
            return False
        self.check_version(version)
        for symbol, build in self.table.items():
            owner, name = resolve(symbol)
            if isinstance(owner, type(sys)):  # a module's function: every public alias of it too
                wrap_module_bindings(self.package, getattr(owner, name), build)
            wrap_once(owner, name, build)
        self.installed = True
        return True


def wrap_module_bindings(prefix: str, function, build: Callable) -> None:
    """Wrap ``function`` wherever a loaded module whose name starts with ``prefix`` binds it (a public
    alias such as ``keras.saving.save_model`` is the same object under several module names)."""
    name = function.__name__
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith(prefix) and getattr(module, name, None) is function:
            wrap_once(module, name, build)


def agree_on_steps(local_steps):
    """The number of steps every worker runs when each inferred ``local_steps`` from its own data
    (None: unknown). Equal counts are kept; different ones become the largest (the others get empty
    batches at the end); if any worker does not know, nobody does (each runs to the end of data)."""
    global _warned_uneven
    import numpy as np
    from .. import collectives
    mine = np.array([-1 if local_steps is None else int(local_steps)], np.int64)
    every = collectives.allgather(mine, backend="grpc")  # a host array: never the default nccl
    if (every == every[0]).all():
        return local_steps
    if not _warned_uneven:
        _warned_uneven = True
        logging.getLogger("tf_commstrategy").warning(
            "tf_commstrategy: workers have different numbers of batches per epoch (%s); every worker runs %s "
            "steps, and workers out of data contribute empty batches", every.tolist(),
            "until all are out of data" if (every < 0).any() else int(every.max()))
    return None if (every < 0).any() else int(every.max())


def is_comm(strategy) -> bool:
    """Whether ``strategy`` is a ``CommStrategy``."""
    from .strategy import CommStrategy
    return isinstance(strategy, CommStrategy)


def is_comm_multi_worker(strategy) -> bool:
    """Whether ``strategy`` is a ``CommStrategy`` of more than one worker."""
    return is_comm(strategy) and strategy.extended._in_multi_worker_mode()


def gathering_predictions(multi_worker_concat: Callable[[], Callable]):
    """A builder for Keras's ``reduce_per_replica(values, strategy, reduction)``: ``predict``'s "concat"
    under a multi-worker CommStrategy goes through Keras's own multi-worker concatenation
    (``multi_worker_concat()(value, strategy)``: ``strategy.gather``, then the replicas in order),
    which Keras uses only for MultiWorkerMirroredStrategy. Other reductions are left to Keras."""
    def build(original):
        def wrapper(values, strategy, reduction):
            if reduction == "concat" and is_comm_multi_worker(strategy):
                import tensorflow as tf
                concat = multi_worker_concat()
                return tf.nest.map_structure(lambda v: concat(v, strategy), values)
            return original(values, strategy, reduction)
        return wrapper
    return build


def reading_locally(original):
    """A wrapper that runs ``original`` with replica-local variables read locally (see
    ``strategy.local_replica_reads``): a save on one rank alone issues no collective, and a reset
    (whose assignment reads the value back) none per variable."""
    def wrapper(*args, **kwargs):
        from .strategy import local_replica_reads
        with local_replica_reads():
            return original(*args, **kwargs)
    return wrapper


def unwrapping_errors(original):
    """A wrapper that re-raises a tf_commstrategy error that reached Keras as TF's ``UnknownError``."""
    def wrapper(*args, **kwargs):
        from .tensor_ops import unwrap_errors
        with unwrap_errors():
            return original(*args, **kwargs)
    return wrapper


# TensorFlow's own SavedModel writer, which tf.saved_model.save, tf_keras's SavedModel format and Keras 3's
# Model.export call: it reads every saved variable's attributes outside its save context.
TF_SAVING = Patches("TensorFlow SavedModel", "tensorflow", ((2, 16), (2, 22)), {
    "tensorflow.python.saved_model.save:save_and_return_nodes": reading_locally,
})
