"""A worker's input without ``MultiDeviceIterator`` when its one replica runs on the CPU.

``tf.distribute`` feeds every worker through a ``MultiDeviceIterator``, built for copying batches to
several devices ahead of time. A worker with a single CPU replica has nowhere to copy to, and pays for
it twice:

* per step, the remote function calls and buffers of the multi-device iterator (a noticeable part of
  a short CPU step);
* once, but for the rest of the process: the iterator is built on a ``GeneratorDataset``, whose kernel
  sets glibc's ``M_MMAP_THRESHOLD`` to 128 KiB on Python 3.11 (TensorFlow's workaround for a
  ``from_generator`` memory growth, ``ApplyPython311MemoryPatch``). From then on every larger
  ``malloc`` is a fresh ``mmap`` whose pages fault in on first touch: thousands of page faults per
  step under CommStrategy (numpy buffers of the gradient all-reduce and the tensors made from them).

For such workers the strategy hands ``input_lib`` options of the ``PlainIteratorOptions`` type, and the
per-worker iterator becomes a plain ``tf.data`` iterator over the same sharded, rebatched dataset.
Everything else of ``tf.distribute``'s input path stays: ``InputContext`` sharding, rebatching, the
partial-batch rule and the cross-worker agreement on the end of data. Workers with several replicas,
or a GPU replica (where prefetching to the device pays), keep the multi-device iterator.

``install`` teaches ``input_lib`` (module-level function ``_should_use_multi_device_iterator`` and
``_SingleWorkerDatasetIteratorBase._format_data_list_with_options``) to recognise these options; it is
idempotent and leaves every other strategy's options untouched.

It also makes such an iterator's type specs once instead of at every step. ``tf_keras`` passes the
iterator to its train function at every step, and ``tf.function`` flattens it by its type spec: the
``DistributedIterator``'s, that spec's component specs (one ``_SingleWorkerDatasetIteratorSpec`` per
worker, whose constructor parses and canonicalizes device names) and the per-worker iterator's own. All
three are rebuilt at each access from values an iterator never changes, which costs a noticeable part
of a short step's ``tf.function`` call.
"""

from __future__ import annotations

from typing import Optional, Sequence

from tensorflow.python.distribute import distribute_lib, input_lib
from tensorflow.python.framework import device as tf_device

_installed = False


class PlainIteratorOptions(distribute_lib.InputOptions):
    """``InputOptions`` that ask for a plain ``tf.data`` iterator on a single-replica worker."""

    tfcs_plain_iterator = True


def _is_plain(options) -> bool:
    return bool(getattr(options, "tfcs_plain_iterator", False))


def install() -> None:
    """Teach ``input_lib`` about ``PlainIteratorOptions`` (idempotent)."""
    global _installed
    if _installed:
        return
    should_use = input_lib._should_use_multi_device_iterator  # pylint: disable=protected-access

    def _should_use_multi_device_iterator(options):
        if _is_plain(options):
            return False
        return should_use(options)

    _should_use_multi_device_iterator.__wrapped__ = should_use
    input_lib._should_use_multi_device_iterator = _should_use_multi_device_iterator

    base = input_lib._SingleWorkerDatasetIteratorBase  # pylint: disable=protected-access
    fmt = base._format_data_list_with_options

    def _format_data_list_with_options(self, data_list):
        if _is_plain(self._options):
            return [data_list]  # one replica: the list of per-device elements has one entry
        return fmt(self, data_list)

    _format_data_list_with_options.__wrapped__ = fmt
    base._format_data_list_with_options = _format_data_list_with_options

    _made_once(input_lib.DistributedIterator, "_type_spec")
    _made_once(input_lib.DistributedIteratorSpec, "_component_specs")
    _made_once(input_lib._SingleWorkerOwnedDatasetIterator, "_type_spec")  # pylint: disable=protected-access
    _installed = True


def _made_once(cls, name: str) -> None:
    """Make the property ``cls.name`` compute its value once per object whose options are
    ``PlainIteratorOptions`` (kept in the object's ``__dict__``); other objects compute it as before.

    Only for properties built from what the object is given at construction and never changes (an
    iterator's workers, devices, element spec, options and cardinality; a spec's, likewise)."""
    original = getattr(cls, name)
    key = "_tfcs_" + name.lstrip("_")

    def get(self):
        made = self.__dict__.get(key)  # the hot path: the value made before
        if made is not None:
            return made
        made = original.fget(self)
        if _is_plain(getattr(self, "_options", None)):
            self.__dict__[key] = made
        return made

    get.__wrapped__ = original.fget
    setattr(cls, name, property(get, doc=original.__doc__))


def options_for(devices: Sequence[str], options) -> Optional[distribute_lib.InputOptions]:
    """The input options to use for a worker with these compute ``devices``.

    Args:
      devices: this worker's replica devices.
      options: the user's ``tf.distribute.InputOptions``, or None.

    Returns:
      ``PlainIteratorOptions`` (with the user's other fields) for one CPU replica fed per worker; else
      ``options`` unchanged.
    """
    if len(devices) != 1 or tf_device.DeviceSpec.from_string(devices[0]).device_type != "CPU":
        return options
    if options is None:
        install()
        return PlainIteratorOptions()
    if options.experimental_replication_mode != distribute_lib.InputReplicationMode.PER_WORKER:
        return options
    install()
    return PlainIteratorOptions(*options)
