"""Every ``TFCS_*`` variable is read in ``config.py``, listed in its ``SETTINGS`` table, and documented in
docs/usage.md by the table generated from it; each type has one strict parser."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from tf_commstrategy import config
from tf_commstrategy.errors import ConfigurationError

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "tf_commstrategy"
NAME = re.compile(r"TFCS_[A-Z0-9_]*[A-Z0-9]")
START, END = "<!-- settings-table: start (make settings-table) -->", "<!-- settings-table: end -->"


#: variables of the GPU check (tests/gpu) and the benchmark scripts, not of the package
HARNESS = {"TFCS_GPU_DRYRUN", "TFCS_GPU_EMULATE_HOSTS", "TFCS_BENCH_PIN"}


def _listed():
    return {n for st in config.SETTINGS for n in st.names}


def _tfcs(node) -> bool:
    """A variable's name: the string itself, or an f-string that makes one (``f"TFCS_TLS_{k}"``)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and bool(NAME.fullmatch(node.value))
    return (isinstance(node, ast.JoinedStr) and bool(node.values) and isinstance(node.values[0], ast.Constant)
            and re.fullmatch(r"TFCS_[A-Z0-9_]*", str(node.values[0].value)) is not None)


def _name(node) -> str:
    return node.value if isinstance(node, ast.Constant) else ast.unparse(node)


def _reads(path: pathlib.Path):
    """(line, name) of every read of a TFCS_* variable: ``env[...]`` loaded, ``.get`` / ``getenv`` /
    ``pop`` / ``env_value`` of the name, and ``name in env``. Writes (``env[...] = ``, ``setdefault``,
    dict keys) are not reads."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _tfcs(node.slice):
            yield node.lineno, _name(node.slice)
        elif isinstance(node, ast.Call) and node.args and _tfcs(node.args[0]):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("get", "getenv", "pop", "env_value"):
                yield node.lineno, _name(node.args[0])
        elif isinstance(node, ast.Compare) and _tfcs(node.left) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            yield node.lineno, _name(node.left)


def test_no_module_but_config_reads_a_tfcs_variable():
    found = [f"{p.relative_to(REPO)}:{line}: {name}" for p in sorted(PACKAGE.rglob("*.py"))
             if p.name != "config.py" or p.parent != PACKAGE for line, name in _reads(p)]
    assert found == [], "read these through a function of tf_commstrategy/config.py"


def test_every_variable_config_reads_is_in_the_table_and_every_row_is_read():
    read = {name for _, name in _reads(PACKAGE / "config.py")}
    assert read, "the scan found no reads in config.py"
    assert read - _listed() == set(), "add these to config.SETTINGS"
    assert not HARNESS & read, "a harness variable became a setting: move it to config.SETTINGS"
    set_by_launcher = {"TFCS_RESTART_COUNT"}  # set by tfcs-run for the user's script, read there
    assert _listed() - read - set_by_launcher == set(), "config.SETTINGS lists variables nothing reads"


def test_every_variable_named_in_the_package_and_the_docs_is_in_the_table():
    named = {}
    for p in list(PACKAGE.rglob("*.py")) + list((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]:
        for name in NAME.findall(p.read_text()):
            named.setdefault(name, str(p.relative_to(REPO)))
    named = {n: where for n, where in named.items() if n != "TFCS_TLS"}  # "TFCS_TLS_*": the TLS variables
    for n in HARNESS:  # the test and benchmark harness's own: documented where they are used, never read here
        named.pop(n, None)
    unknown = {n: where for n, where in named.items() if n not in _listed()}
    assert unknown == {}, "undocumented variables (add them to config.SETTINGS) or stale names"


def test_docs_usage_holds_the_generated_table():
    text = (REPO / "docs" / "usage.md").read_text()
    assert START in text and END in text, f"docs/usage.md needs the markers {START!r} and {END!r}"
    held = text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    assert held == config.settings_table(), "docs/usage.md's table is stale: run `make settings-table`"


@pytest.mark.parametrize("text,value", [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                        ("0", False), ("false", False), ("No", False), ("off", False)])
def test_one_boolean_spelling(text, value):
    assert config.parse_bool(text) is value


@pytest.mark.parametrize("reader,name,bad", [
    (config.hierarchical_from_env, "TFCS_HIERARCHICAL", "maybe"),
    (config.nccl_check_from_env, "TFCS_NCCL_CHECK", "2"),
    (config.native_from_env, "TFCS_NATIVE", "sometimes"),
    (config.heap_from_env, "TFCS_HEAP", "always"),
    (config.timeout_from_env, "TFCS_TIMEOUT", "-1"),
    (config.timeout_from_env, "TFCS_TIMEOUT", "inf"),
    (config.heartbeat_timeout_from_env, "TFCS_HEARTBEAT_TIMEOUT", "-0.5"),
    (config.chunk_bytes_from_env, "TFCS_CHUNK_BYTES", "4Q"),
    (config.transport_from_env, "TFCS_TRANSPORT", "carrier-pigeon"),
    (config.coordinator_port_from_env, "TFCS_COORDINATOR_PORT", "80.5"),
    (config.tfcs_cluster_from_env, "TFCS_RANK", "one"),
])
def test_an_invalid_value_is_an_error_naming_the_variable(reader, name, bad):
    env = {name: bad, "TFCS_WORLD_SIZE": "2"} if name == "TFCS_RANK" else {name: bad}
    with pytest.raises(ConfigurationError) as e:
        reader(env)
    assert f"{name}={bad!r}" in str(e.value)


def test_values_and_defaults():
    assert config.hierarchical_from_env({}) is True and config.hierarchical_from_env({"TFCS_HIERARCHICAL": "off"}) is False
    assert config.native_from_env({"TFCS_NATIVE": "YES"}) == "on" and config.native_from_env({}) == "auto"
    assert config.heap_from_env({"TFCS_HEAP": "0"}) == "off" and config.heap_from_env({"TFCS_HEAP": "on"}) == "auto"
    assert config.tfcs_cluster_from_env({"TFCS_RANK": "1"}) is None
    assert config.tfcs_cluster_from_env({"TFCS_RANK": "1", "TFCS_WORLD_SIZE": "3", "TFCS_LOCAL_RANK": "0"}) == (1, 3, 0)
    assert config.tls_files_from_env({"TFCS_TLS_CA": " ca.pem "}) == ("", "", "ca.pem", None)
    assert config.bench_ports_from_env({"TFCS_BENCH_PORTS": "5,6"}) == [5, 6]
