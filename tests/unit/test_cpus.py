"""core.cpus: the cores a process may use, from its affinity mask and a cgroup CPU quota."""

import math
import os

from tf_commstrategy.core import cpus


def _files(tmp_path, v2=None, v1=None):
    p2 = tmp_path / "cpu.max"
    if v2 is not None:
        p2.write_text(v2)
    q, p = tmp_path / "quota", tmp_path / "period"
    if v1 is not None:
        q.write_text(v1[0])
        p.write_text(v1[1])
    return str(p2), (str(q), str(p))


def test_quota_from_cgroup_v2_and_v1(tmp_path):
    assert cpus.quota_cores(*_files(tmp_path, v2="150000 100000\n")) == 1.5
    unlimited = tmp_path / "unlimited"
    unlimited.mkdir()
    assert cpus.quota_cores(*_files(unlimited, v2="max 100000")) is None
    d = tmp_path / "v1"
    d.mkdir()
    assert cpus.quota_cores(*_files(d, v1=("200000", "100000"))) == 2.0
    e = tmp_path / "v1none"
    e.mkdir()
    assert cpus.quota_cores(*_files(e, v1=("-1", "100000"))) is None
    f = tmp_path / "nothing"
    f.mkdir()
    assert cpus.quota_cores(*_files(f)) is None


def test_usable_cores_is_the_affinity_mask_capped_by_the_quota(monkeypatch):
    mask = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cpus, "quota_cores", lambda: None)
    assert cpus.usable_cores() == mask
    monkeypatch.setattr(cpus, "quota_cores", lambda: 0.5)
    assert cpus.usable_cores() == 1  # a fraction of a core is still one
    monkeypatch.setattr(cpus, "quota_cores", lambda: mask + 7.0)
    assert cpus.usable_cores() == mask  # a quota above the mask changes nothing
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    monkeypatch.setattr(cpus, "quota_cores", lambda: 2.5)
    assert cpus.usable_cores() == math.ceil(2.5)
