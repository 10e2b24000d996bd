"""The Keras patch tables: every patched symbol exists in the installed Keras, the version guards refuse
versions the patches were not written for, and installing twice wraps once."""

import pytest

from tf_commstrategy.errors import ConfigurationError


def _tables():
    from tf_commstrategy.tf import keras3_compat, tf_keras_compat
    from tf_commstrategy.tf.keras_patches import TF_SAVING
    return {"keras3": keras3_compat.PATCHES, "tf_keras": tf_keras_compat.PATCHES, "tf": TF_SAVING}


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras", "tf"])
def test_every_patched_symbol_exists_and_the_installed_version_is_supported(flavour):
    from tf_commstrategy.tf.keras_patches import resolve
    patches = _tables()[flavour]
    assert len(patches.table) >= 1
    for symbol in patches.table:
        owner, name = resolve(symbol)  # ImportError / AttributeError when Keras moved it
        assert callable(getattr(owner, name)), symbol
    patches.check_version(patches.version())  # the pinned versions are the supported ones


def test_the_keras3_table_covers_what_the_module_says_it_changes():
    symbols = set(_tables()["keras3"].table)
    for needed in ("TFOptimizer.apply", "LossScaleOptimizer.apply", "TensorFlowTrainer._make_function",
                   "Trainer.get_metrics_result", ":reduce_per_replica", "TFEpochIterator.__init__",
                   "TensorFlowTrainer.fit", "Model.save", "ModelCheckpoint._save_model",
                   "BackupAndRestore.on_train_begin"):
        assert any(s.endswith(needed) for s in symbols), needed


@pytest.mark.parametrize("version,ok", [("3.12.0", True), ("3.15.1", True), ("3.11.3", False), ("3.16.0", False),
                                        ("4.0", False)])
def test_keras3_version_guard(version, ok):
    patches = _tables()["keras3"]
    if ok:
        patches.check_version(version)
        return
    with pytest.raises(ConfigurationError) as e:
        patches.check_version(version)
    msg = str(e.value)
    assert version in msg and "3.12" in msg and "3.16" in msg and "pip install" in msg


def test_install_refuses_an_unsupported_version_loudly_and_patches_nothing(monkeypatch):
    from tf_commstrategy.tf.keras_patches import Patches
    calls = []
    patches = Patches("Keras 3", "keras", ((3, 12), (3, 16)),
                      {"keras.src.models.model:Model.save": lambda original: calls.append(1) or original})
    monkeypatch.setattr(patches, "version", lambda: "3.99.0")
    with pytest.raises(ConfigurationError, match="3.99.0"):
        patches.install()
    assert calls == [] and not patches.installed


def test_a_missing_package_is_nothing_to_teach(monkeypatch):
    from tf_commstrategy.tf.keras_patches import Patches
    patches = Patches("x", "no_such_package_tfcs", ((1, 0), (2, 0)), {"no_such_package_tfcs:f": None})
    assert patches.install() is False


def test_wrap_once_keeps_one_wrapper_and_the_original():
    from tf_commstrategy.tf.keras_patches import wrap_once

    class Owner:
        @staticmethod
        def f(x):
            """doc"""
            return x

    def build(original):
        return lambda x: original(x) + 1
    wrap_once(Owner, "f", build)
    wrap_once(Owner, "f", build)  # a second install
    assert Owner.f(1) == 2 and Owner.f.__doc__ == "doc" and Owner.f.__wrapped__(1) == 1


def test_parse_version():
    from tf_commstrategy.tf.keras_patches import parse_version
    assert parse_version("3.15.1") == (3, 15) and parse_version("2.21.0rc1") == (2, 21) and parse_version("3") == (3, 0)
