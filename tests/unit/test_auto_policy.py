"""The "auto" policy's reading of a tensor's device: the device type, never the job's name."""

import types

import pytest

from tf_commstrategy.core.device_arrays import device_type, is_gpu_buffer


@pytest.mark.parametrize("device,kind", [
    ("/job:localhost/replica:0/task:0/device:GPU:0", "GPU"),
    ("/job:gpuworker/replica:0/task:1/device:CPU:0", "CPU"),  # "gpu" in the job's name only
    ("/job:worker/replica:0/task:0/device:gpu:1", "GPU"),
    ("GPU:0", "GPU"), ("/gpu:1", "GPU"), ("/device:CPU:0", "CPU"),
    ("/job:worker/task:0", ""), ("", ""),
])
def test_device_type(device, kind):
    assert device_type(device) == kind


def test_a_cpu_tensor_of_a_job_named_after_gpus_is_not_a_gpu_buffer():
    assert not is_gpu_buffer(types.SimpleNamespace(device="/job:gpu_workers/replica:0/task:0/device:CPU:0"))
    assert is_gpu_buffer(types.SimpleNamespace(device="/job:cpu_pool/replica:0/task:0/device:GPU:0"))
