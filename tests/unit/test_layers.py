"""The package's layers (docs/architecture.md), checked on its source: every import of the package's own
modules, lazy ones inside functions included, goes to the module's own layer or one below.

A new upward import fails here with the line that makes it. The layers, lowest first, and what each may
not do beyond that:

* base: ``errors``, ``config``, ``heap``;
* core: ``core/`` (buffers, algorithms, the Backend interface, shared-memory and device-array primitives);
* rendezvous: ``rendezvous/``;
* backends: ``backends/``;
* direct API: ``process_group``, ``process``, ``collectives``; only ``process`` imports the ``backends``
  package (which registers them), nothing here imports a backend's modules;
* TF layer: ``tf/``; reaches the backends through the Backend interface only (no ``backends`` import);
* Keras callbacks: ``callbacks/``; no ``backends`` import either;
* Horovod API: ``horovod/`` (Horovod's TensorFlow API on the layers below); no ``backends`` import;
* tools and the facade: ``launcher/``, ``bench/``, ``run``, and the package's ``__init__`` (the public API).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap
from typing import Iterator, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "tf_commstrategy"
PKG = "tf_commstrategy"

LAYERS = [  # lowest first
    ("base", ("errors", "config", "heap")),
    ("core", ("core",)),
    ("rendezvous", ("rendezvous",)),
    ("backends", ("backends",)),
    ("direct API", ("process_group", "process", "collectives")),
    ("TF layer", ("tf",)),
    ("Keras callbacks", ("callbacks",)),
    ("Horovod API", ("horovod",)),
    ("tools and the facade", ("launcher", "bench", "run", "")),
]
#: above the backends, only these modules import the backends package (to register the backends)
BACKEND_REGISTRARS = {f"{PKG}.process"}


def _layer(module: str) -> int:
    rel = module[len(PKG) + 1:] if module != PKG else ""
    top = rel.split(".")[0]
    for i, (_, heads) in enumerate(LAYERS):
        if top in heads:
            return i
    raise AssertionError(f"module {module} belongs to no layer: add it to LAYERS in {__file__}")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> Iterator[Tuple[int, str]]:
    """(line, imported module) for every import of the package's own modules in ``path``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PKG or target.startswith(PKG + "."):
                # "from . import x" names modules: judge each (x may be a module of a lower layer)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    yield node.lineno, sub if (ROOT.parent / sub.replace(".", "/")).exists() or \
                        (ROOT.parent / (sub.replace(".", "/") + ".py")).exists() else target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PKG or alias.name.startswith(PKG + "."):
                    yield node.lineno, alias.name


def _violations():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        mine = _layer(module)
        for line, target in _imports(path):
            theirs = _layer(target)
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            if theirs > mine:
                found.append(f"{where}: {module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
            elif (LAYERS[mine][0] not in ("backends", "tools and the facade") and LAYERS[theirs][0] == "backends"
                  and module not in BACKEND_REGISTRARS):
                found.append(f"{where}: {module} ({LAYERS[mine][0]}) reaches into {target}; use the Backend "
                             f"interface (core/backend.py)")
    return found


def test_no_module_imports_a_layer_above_its_own():
    assert _violations() == []


def test_the_check_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The check finds an upward import inside a function, and one written relatively."""
    fake = tmp_path / PKG
    (fake / "core").mkdir(parents=True)
    (fake / "tf").mkdir()
    for p in (fake / "__init__.py", fake / "core" / "__init__.py", fake / "tf" / "__init__.py",
              fake / "tf" / "tensor_ops.py"):
        p.write_text("")
    (fake / "core" / "ring.py").write_text("def f():\n    from ..tf import tensor_ops\n")
    (fake / "collectives.py").write_text("import tf_commstrategy.backends.host.wire\n")
    (fake / "backends").mkdir()
    (fake / "backends" / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    found = _violations()
    assert any("core/ring.py:2" in v and "tf_commstrategy.tf.tensor_ops (TF layer)" in v for v in found), found
    assert any("collectives.py:1" in v and "reaches into" in v for v in found), found


@pytest.mark.timeout(120)
def test_the_package_and_the_direct_api_run_without_tensorflow():
    """Two workers started by tfcs-run use every function of the direct API on numpy arrays; neither
    TensorFlow nor Keras is imported on the way."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import tf_commstrategy as tfcs
        tfcs.init()
        r, n = tfcs.rank(), tfcs.size()
        x = np.arange(6, dtype=np.float32) + r
        ok = [
            np.array_equal(tfcs.allreduce(x), sum(np.arange(6, dtype=np.float32) + i for i in range(n))),
            [a.tolist() for a in tfcs.grouped_allreduce([x, x[:2]], op="max")] == [
                (np.arange(6) + n - 1).tolist(), [n - 1.0, n + 0.0]],
            tfcs.broadcast(x, root_rank=1).tolist() == (np.arange(6) + 1).tolist(),
            [a.tolist() for a in tfcs.grouped_broadcast([x], root_rank=0)] == [np.arange(6).tolist()],
            tfcs.allgather(np.full(r + 1, r)).tolist() == [0, 1, 1],
            tfcs.reduce_scatter(np.ones(4), op="sum").tolist() == [float(n)] * 2,
            tfcs.shared_empty(4).shape == (4,),
            tfcs.local_rank() == r and tfcs.local_size() == n,
        ]
        tfcs.barrier()
        tfcs.shutdown()
        loaded = sorted(m for m in ("tensorflow", "keras", "tf_keras", "tf_commstrategy.tf") if m in sys.modules)
        print(f"rank {r}: ok={ok} loaded={loaded}")
        sys.exit(0 if all(ok) and not loaded else 1)
    """)
    proc = subprocess.run([sys.executable, "-m", "tf_commstrategy.run", "-np", "2", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=100)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in (0, 1):
        assert f"rank {r}: ok=[True, True, True, True, True, True, True, True] loaded=[]" in out, out
