"""How CommCrossDeviceOps groups a batch of tensors into fused buffers (one dtype each, bounded size)."""

from tf_commstrategy.tf.cross_device_ops import fusion_groups


def test_one_group_per_dtype_in_order_of_first_appearance():
    assert fusion_groups(["f32", "i64", "f32", "f16", "i64"], [4, 8, 4, 2, 8], 0) == [[0, 2], [1, 4], [3]]


def test_pack_size_cuts_each_dtype_group():
    # 4 float32 tensors of 100 bytes, packs of 250 bytes: two per bucket
    assert fusion_groups(["f"] * 4, [100] * 4, 250) == [[0, 1], [2, 3]]
    # a tensor larger than the pack is a bucket of its own
    assert fusion_groups(["f"] * 3, [100, 1000, 100], 250) == [[0], [1], [2]]
    assert fusion_groups(["f"] * 3, [100, 100, 100], -1) == [[0, 1, 2]]


def test_unknown_sizes_close_their_bucket_when_packing():
    assert fusion_groups(["f"] * 3, [100, -1, 100], 1000) == [[0], [1, 2]]
    assert fusion_groups(["f"] * 3, [100, -1, 100], 0) == [[0, 1, 2]]
