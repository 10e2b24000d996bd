"""Horovod's Keras MNIST example (examples/tensorflow2/tensorflow2_keras_mnist.py) on tf_commstrategy.

    tfcs-run -np 2 python examples/horovod_keras_mnist.py [--epochs 24] [--steps-per-epoch 250]

The training code is Horovod's, with ``import horovod.tensorflow.keras as hvd`` replaced by
``import tf_commstrategy.horovod as hvd``. What else differs: ``TF_USE_LEGACY_KERAS=1`` is set before
TensorFlow is imported (on TensorFlow 2.16 and later ``tf.keras`` is Keras 3 otherwise, and Horovod's
optimizer wraps tf_keras optimizers), the data come from ``keras_mnist.load_data`` (the real MNIST when it
is in the Keras cache, else synthetic MNIST-shaped data: nothing is downloaded), options shorten the run,
the checkpoints go to a temporary directory, and a global test accuracy is printed at the end.
"""

import argparse
import os
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tf_commstrategy.horovod as hvd  # noqa: E402  (was: import horovod.tensorflow.keras as hvd)
from keras_mnist import load_data  # noqa: E402  (the data of examples/keras_mnist.py)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=24)
    p.add_argument("--steps-per-epoch", type=int, default=500, help="divided by the number of workers")
    p.add_argument("--train-samples", type=int, default=12000)
    p.add_argument("--test-samples", type=int, default=2000)
    p.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "horovod_keras_mnist"))
    a = p.parse_args()

    # Horovod: initialize Horovod.
    hvd.init()

    # Horovod: pin GPU to be used to process local rank (one GPU per process)
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

    (mnist_images, mnist_labels), (test_images, test_labels), source = load_data(a.train_samples, a.test_samples)
    if hvd.rank() == 0:
        print(f"data: {source}; {hvd.size()} workers")

    dataset = tf.data.Dataset.from_tensor_slices((mnist_images, mnist_labels))
    dataset = dataset.repeat().shuffle(10000).batch(128)

    mnist_model = tf.keras.Sequential([
        tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
        tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(128, activation='relu'),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation='softmax')
    ])

    # Horovod: adjust learning rate based on number of GPUs.
    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)

    # Horovod: add Horovod DistributedOptimizer.
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True)

    # Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
    # uses hvd.DistributedOptimizer() to compute gradients.
    mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                        optimizer=opt,
                        metrics=['accuracy'],
                        experimental_run_tf_function=False)

    callbacks = [
        # Horovod: broadcast initial variable states from rank 0 to all other processes.
        # This is necessary to ensure consistent initialization of all workers when
        # training is started with random weights or restored from a checkpoint.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),

        # Horovod: average metrics among workers at the end of every epoch.
        #
        # Note: This callback must be in the list before the ReduceLROnPlateau,
        # TensorBoard or other metrics-based callbacks.
        hvd.callbacks.MetricAverageCallback(),

        # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
        # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
        # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
    ]

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0:
        os.makedirs(a.checkpoint_dir, exist_ok=True)
        callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(a.checkpoint_dir, 'checkpoint-{epoch}.h5')))

    # Horovod: write logs on worker 0.
    verbose = 1 if hvd.rank() == 0 else 0

    # Train the model.
    # Horovod: adjust number of steps based on number of GPUs.
    mnist_model.fit(dataset, steps_per_epoch=a.steps_per_epoch // hvd.size(), callbacks=callbacks, epochs=a.epochs,
                    verbose=verbose)

    # Each worker evaluates its shard of the test set; the average over workers is the global result.
    test = tf.data.Dataset.from_tensor_slices((test_images, test_labels)).shard(hvd.size(), hvd.rank()).batch(128)
    loss, accuracy = mnist_model.evaluate(test, verbose=0)
    loss, accuracy = hvd.allreduce([loss, accuracy], op=hvd.Average).numpy()
    if hvd.rank() == 0:
        print(f"final: test accuracy {accuracy:.4f}, loss {loss:.4f} on {hvd.size()} workers")


if __name__ == '__main__':
    main()
