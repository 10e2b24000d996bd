"""The code blocks of the Quickstart, Backends and Launching pages are what a newcomer runs.

Every fenced block of those pages is exactly one of:

* **run**: a ``bash`` block without a marker. It runs here for real, from the repository root, with
  this interpreter's ``bin`` first on ``PATH`` and no launcher variables inherited, and must exit 0.
  An output block right after it (``<!-- output -->``: the same lines in any order;
  ``<!-- output: excerpt -->``: every line shown appears, numbers and ``...`` free) is compared with
  what it printed.
* **file**: ``<!-- file: PATH -->`` before it: the block is the verbatim content of PATH, and PATH is
  run by a run block of these pages or by the test named in ``RUN_BY``.
* **not-run**: ``<!-- not-run: REASON -->`` before it (rare: e.g. it needs a real cluster).

Anything else (an unmarked ``python`` or ``yaml`` block, an output block with nothing to compare
against) fails ``test_every_block_is_run_verbatim_or_marked``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from typing import List, Optional, Tuple

import pytest

from tests.helpers import ROOT

DOCS = os.path.join(ROOT, "docs")
PAGES = ("quickstart.md", "backends.md", "launching.md")
RUN_LANGS = ("bash", "sh", "shell")
MAX_NOT_RUN = 3

# Files shown verbatim that no block of these pages runs: the test that runs (or simulates) each one.
RUN_BY = {
    "examples/launch/slurm.sbatch": "tests/engines/test_slurm.py::test_sbatch_recipe_trains_to_the_end",
    "examples/launch/mpirun.sh": "tests/engines/test_mpirun.py::test_mpirun_recipe_trains_to_the_end",
    "examples/launch/tfjob.yaml":
        "tests/unit/test_launch_recipes.py::test_tfjob_recipe_is_a_tfjob_the_training_operator_accepts",
    "examples/launch/any_engine.sh":
        "tests/multiprocess/test_examples.py::test_any_engine_recipe_runs_a_single_worker_job",
    "examples/keras_mnist.py": "tests/multiprocess/test_examples.py::test_example_runs_on_two_workers",
}

# Variables a launcher sets: a block must not inherit them from whatever runs the tests.
ENGINE_VARS = re.compile(r"^(TFCS_|SLURM_|OMPI_|PMI_|PMIX_|TF_CONFIG$|RANK$|WORLD_SIZE$|LOCAL_RANK$|LOCAL_SIZE$|"
                         r"MASTER_ADDR$|MASTER_PORT$|MAKEFLAGS$|MAKELEVEL$|MFLAGS$)")
MARKER = re.compile(r"^<!--\s*(file|not-run|output)\s*(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
BLOCK_TIMEOUT_S = 240


@dataclasses.dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    marker: Optional[Tuple[str, Optional[str]]]  # ("file", path) | ("not-run", reason) | ("output", None|"excerpt")

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        if self.marker is not None:
            return self.marker[0]
        return "run" if self.lang in RUN_LANGS else "unmarked"


def parse_blocks(page: str) -> List[Block]:
    """The fenced blocks of ``docs/PAGE``, each with the marker comment on the line right before it."""
    with open(os.path.join(DOCS, page)) as f:
        lines = f.read().splitlines()
    blocks, marker, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        m = MARKER.match(line.strip())
        if m:
            marker = (m.group(1), m.group(2) or None)
            i += 1
            continue
        f = FENCE.match(line)
        if f:
            fence = f.group(1)
            j = i + 1
            while j < len(lines) and lines[j].strip() != fence:
                j += 1
            assert j < len(lines), f"{page}:{i + 1}: unclosed code block"
            blocks.append(Block(page, i + 1, f.group(2).lower(), "\n".join(lines[i + 1:j]) + "\n", marker))
            marker, i = None, j + 1
            continue
        if line.strip():
            marker = None  # a marker belongs to the block right after it
        i += 1
    return blocks


ALL = [b for p in PAGES for b in parse_blocks(p)]
# Elsewhere in the docs only file blocks are checked (they must still be verbatim and run by a test).
OTHER_FILE_BLOCKS = [b for p in sorted(os.listdir(DOCS)) if p.endswith(".md") and p not in PAGES
                     for b in parse_blocks(p) if b.kind == "file"]


def _output_after(block: Block) -> Optional[Block]:
    blocks = [b for b in ALL if b.page == block.page]
    k = blocks.index(block)
    nxt = blocks[k + 1] if k + 1 < len(blocks) else None
    return nxt if nxt is not None and nxt.kind == "output" else None


def test_every_block_is_run_verbatim_or_marked():
    assert {p for p in PAGES if parse_blocks(p)} == set(PAGES), "a page lost its code blocks"
    problems = []
    for i, b in enumerate(ALL):
        if b.kind == "unmarked":
            problems.append(f"{b.id}: a {b.lang or 'plain'} block that is not run: put it in a file that a test runs "
                            f"and mark it <!-- file: PATH -->, or mark it <!-- not-run: REASON -->")
        elif b.kind == "not-run" and len(b.marker[1] or "") < 10:
            problems.append(f"{b.id}: not-run without a reason")
        elif b.kind == "output":
            prev = ALL[i - 1] if i > 0 and ALL[i - 1].page == b.page else None
            if prev is None or prev.kind != "run" or b.marker[1] not in (None, "excerpt"):
                problems.append(f"{b.id}: an output block must follow a run block (marker: output or output: excerpt)")
    assert not problems, "\n".join(problems)
    not_run = [b.id for b in ALL if b.kind == "not-run"]
    assert len(not_run) <= MAX_NOT_RUN, f"keep not-run blocks rare: {not_run}"


def _runs_of(path: str) -> List[str]:
    return [b.id for b in ALL if b.kind == "run" and path in b.text]


@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "file"] + OTHER_FILE_BLOCKS, ids=lambda b: b.id)
def test_file_block_is_verbatim_and_that_file_is_run(block):
    path = block.marker[1]
    with open(os.path.join(ROOT, path)) as f:
        content = f.read()
    assert block.text == content, f"{block.id} differs from {path}: copy the file into the page again"
    if _runs_of(path):
        return
    assert path in RUN_BY, f"{path} is shown on {block.page} but nothing runs it: add a run block or a RUN_BY entry"
    test_file, test_name = RUN_BY[path].split("::")
    with open(os.path.join(ROOT, test_file)) as f:
        source = f.read()
    assert f"def {test_name}(" in source, f"{RUN_BY[path]} does not exist"
    assert os.path.basename(path) in source, f"{test_file} does not use {path}"


# -- running the run blocks ---------------------------------------------------------------------------

NUM = r"\d[\d,]*(?:\.\d+)?(?:(?:ms|us|µs|s)(?![A-Za-z]))?"
RANK_PREFIX = re.compile(r"^(\[\d+\] )")


def _line_pattern(doc_line: str) -> re.Pattern:
    """A documented output line as a regex: numbers match any number (with any time unit), ``...`` anything."""
    m = RANK_PREFIX.match(doc_line)
    prefix, rest = (re.escape(m.group(1)), doc_line[m.end():]) if m else ("", doc_line)
    parts = re.split(rf"({NUM}|\.\.\.)", rest)
    out = []
    for k, part in enumerate(parts):
        if k % 2 == 0:
            out.append(re.escape(part))
        else:
            out.append(".*" if part == "..." else NUM)
    return re.compile(prefix + "".join(out))


def _lines(text: str) -> List[str]:
    return [ln.strip() for ln in re.split(r"[\r\n\x08]+", text) if ln.strip()]


def check_output(expected: Block, stdout: str, stderr: str) -> None:
    want = [ln.rstrip() for ln in expected.text.splitlines() if ln.strip()]
    if expected.marker[1] == "excerpt":
        got = _lines(stdout + "\n" + stderr)
        missing = [w for w in want if w.strip() != "..." and
                   not any(_line_pattern(w.strip()).fullmatch(g) for g in got)]
        assert not missing, f"{expected.id}: not in the output: {missing}\n--- stdout:\n{stdout[-3000:]}"
    else:
        # Every line shown, each once, in any order, and nothing else. Workers that share a terminal
        # (no tfcs-run in between) may write their lines back to back, so lines are cut out of the text
        # rather than compared after splitting it.
        rest = stdout
        for w in sorted(want, key=len, reverse=True):
            assert w in rest, f"{expected.id}: {w!r} is not in the output\n--- stdout:\n{stdout[-3000:]}"
            rest = rest.replace(w, "\n", 1)
        assert not rest.strip(), f"{expected.id}: the output has more than the page shows: {rest.strip()[:2000]!r}"


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not ENGINE_VARS.match(k)}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["HOME"] = str(tmp_path)  # no Keras dataset cache, no user config: what a fresh machine sees
    env["TFCS_RENDEZVOUS_TIMEOUT"] = env["TFCS_TIMEOUT"] = "60"  # a broken block fails in a minute, never hangs
    return env


def _prepare(text: str) -> str:
    venv_bin = os.path.join(ROOT, ".venv", "bin")
    if ". .venv/bin/activate" in text or "make " in text:
        if not os.path.exists(os.path.join(venv_bin, "activate")):
            pytest.skip("the block uses the repository's .venv, which does not exist here")
        if os.path.realpath(os.path.dirname(sys.executable)) != os.path.realpath(venv_bin):
            pytest.skip("the block uses the repository's .venv; these tests run in another environment")
    # `make demo` as documented, except that the setup step (pip install into .venv) is not redone
    # while other tests use that environment: `-o` takes .venv as installed (make test did that).
    return re.sub(r"^make demo\b", "make -o .venv/.installed demo", text, flags=re.M)


def run_block(block: Block, tmp_path) -> Tuple[str, str]:
    p = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", _prepare(block.text)], cwd=ROOT,
                         env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, err = p.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the block's background workers too
        out, err = p.communicate()
        pytest.fail(f"{block.id} ran past {BLOCK_TIMEOUT_S} s\n{out[-2000:]}\n{err[-3000:]}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # nothing the block started outlives it
        except ProcessLookupError:
            pass
    assert p.returncode == 0, \
        f"{block.id} exited {p.returncode}\n--- stdout:\n{out[-3000:]}\n--- stderr:\n{err[-4000:]}"
    return out, err


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", [b for b in ALL if b.kind == "run"], ids=lambda b: b.id)
def test_run_block(block, tmp_path):
    out, err = run_block(block, tmp_path)
    expected = _output_after(block)
    if expected is not None:
        check_output(expected, out, err)


# -- the checker checks ------------------------------------------------------------------------------

def test_excerpt_lines_match_numbers_and_ellipses_only():
    pat = _line_pattern("[0] 64/64 - 1s - loss: 0.5425 - 405ms/epoch - 3,286 samples/s ... done")
    assert pat.fullmatch("[0] 64/64 - 0s - loss: 0.1 - 1s/epoch - 12,001 samples/s on 2 workers, grpc done")
    assert not pat.fullmatch("[1] 64/64 - 0s - loss: 0.1 - 1s/epoch - 12,001 samples/s done")  # other rank
    assert not pat.fullmatch("[0] 64/64 - 0s - accuracy: 0.1 - 1s/epoch - 12,001 samples/s done")  # other word


def test_markers_attach_to_the_next_block_only(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("<!-- not-run: needs a cluster of its own -->\n```bash\nsbatch x\n```\n\n"
                    "<!-- file: x.py -->\n\ntext in between\n```python\nprint(1)\n```\n"
                    "```bash\necho hi\n```\n<!-- output -->\n```text\nhi\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "DOCS", str(tmp_path))
    kinds = [(b.kind, b.lang) for b in parse_blocks("page.md")]
    assert kinds == [("not-run", "bash"), ("unmarked", "python"), ("run", "bash"), ("output", "text")]
