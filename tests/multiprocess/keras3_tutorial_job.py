"""TensorFlow's "Multi-worker training with Keras" tutorial, with ``tf.distribute.MultiWorkerMirroredStrategy()``
replaced by ``tfcs.CommStrategy()`` and nothing else changed but what this machine needs: MNIST-shaped
synthetic data (nothing is downloaded), a ``.keras`` file name (Keras 3 saves to one) and shorter epochs.

Started by hand once per worker with ``TF_CONFIG``; ``tf.keras`` is Keras 3. Writes the final weights of
both fits to ``OUT/weights{task}.npz`` for the test to compare.

    TF_CONFIG='{"cluster": {"worker": ["localhost:P0", "localhost:P1"]}, "task": {"type": "worker", "index": 0}}' \
        python keras3_tutorial_job.py OUT
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

import tf_commstrategy as tfcs

out_dir = sys.argv[1]


# mnist_setup.py, as in the tutorial (the data made here instead of downloaded)
def mnist_dataset(batch_size):
    rng = np.random.default_rng(0)
    templates = rng.random((10, 28, 28)) > 0.7
    y_train = rng.integers(0, 10, 6000)
    x_train = np.clip(templates[y_train] * 90 + rng.normal(0, 110, (6000, 28, 28)), 0, 255).astype(np.uint8)
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = tf.data.Dataset.from_tensor_slices(
        (x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
    return train_dataset


def build_and_compile_cnn_model():
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(28, 28)),
        tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation='relu'),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dense(10)
    ])
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=['accuracy'])
    return model


# main.py
per_worker_batch_size = 64
tf_config = json.loads(os.environ['TF_CONFIG'])
num_workers = len(tf_config['cluster']['worker'])

strategy = tfcs.CommStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_dataset(global_batch_size)
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
multi_worker_dataset = multi_worker_dataset.with_options(options)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = build_and_compile_cnn_model()

multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=20)
first_fit = [w for w in multi_worker_model.get_weights()]

# Model saving, as in the tutorial: the chief writes the real path, the others a temporary one they delete
model_path = os.path.join(out_dir, 'keras-model.keras')


def _is_chief(task_type, task_id):
    # Note: there are two possible `TF_CONFIG` configurations.
    #   1) In addition to `worker` tasks, a `chief` task type is use;
    #      in this case, this function should be modified to
    #      `return task_type == 'chief'`.
    #   2) Only `worker` task type is used; in this case, worker 0 is
    #      regarded as the chief. The implementation demonstrated here
    #      is for this case.
    # For the purpose of this Colab section, the `task_type` is `None` case
    # is added because it is effectively run with only a single worker.
    return (task_type == 'worker' and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = 'workertemp_' + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type,
                      strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)
multi_worker_model.save(write_model_path)
if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))

# Model saving and loading: BackupAndRestore, as in the tutorial
callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=os.path.join(out_dir, 'backup'))]
with strategy.scope():
    multi_worker_model = build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=20, callbacks=callbacks)

np.savez(os.path.join(out_dir, f"weights{task_id}.npz"), *first_fit, *multi_worker_model.get_weights(),
         keras=np.array(type(multi_worker_model).__module__))
