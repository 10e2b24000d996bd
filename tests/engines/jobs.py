"""Running an engine's command as a user would, and the facts the engine tests check in its output."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import List, Optional

from tests.engines.conftest import ROOT

LOOP_WORKER = os.path.join(ROOT, "tests", "netns", "workers.py")


class Command:
    """A command started in ROOT; its merged output is collected line by line."""

    def __init__(self, argv: List[str], env: dict):
        self.lines: List[str] = []
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._t = threading.Thread(target=self._pump, daemon=True)
        self._t.start()

    def _pump(self):
        for raw in iter(self.proc.stdout.readline, b""):
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    def wait(self, timeout: float) -> Optional[int]:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = None
        self._t.join(10)
        return code

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_progress(self, ranks: int, count: int, timeout: float) -> None:
        """Every one of ``ranks`` loop workers printed ``progress <count>`` (or more)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            seen = sum(1 for line in self.lines if line.startswith(f"progress {count}"))
            if seen >= ranks:
                return
            time.sleep(0.1)
        raise AssertionError(f"{ranks} ranks did not reach {count} all-reduces in {timeout} s "
                             f"(rc={self.proc.poll()}):\n" + self.output()[-5000:])


def find_worker(needle: str, rank_var: str, rank: int) -> int:
    """The pid of the process whose command line holds ``needle`` and whose environment has
    ``rank_var=rank`` (the engine's own rank variable)."""
    want = f"{rank_var}={rank}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if needle.encode() not in cmd or b"python" not in cmd:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    return int(pid)
        except OSError:
            continue
    raise AssertionError(f"no process with {needle!r} and {rank_var}={rank}")


def final_lines(lines: List[str]) -> List[str]:
    return [line for line in lines if "final: test accuracy" in line]


def kill_rank_and_check(job: Command, out_dir: str, rank_var: str, source: str, engine: str) -> None:
    """Once both loop workers of ``job`` made progress, SIGKILL rank 1 (found by ``rank_var``); the engine's
    command must then end with a non-zero code within 30 s, after the survivor's PeerLostError, and both
    ranks must have joined through the engine's own variables (``source``)."""
    job.wait_for_progress(2, 10, 120)
    victim = find_worker(out_dir, rank_var, 1)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = job.wait(60)
    took = time.monotonic() - t0
    out = job.output()
    assert code not in (0, None), out[-4000:]
    assert out.count(f"joined via {source}") == 2, "ranks must come from the engine's own variables"
    assert "error PeerLostError" in out, out[-4000:]
    assert took < 30, f"{engine} took {took:.1f} s to end after rank 1 was killed"


def check_batch_job(code: Optional[int], job: Command, directory, workers: int, log: str) -> None:
    """``sbatch --wait`` of the recipe (its output in ``directory``/slurm-*.out) trained to the end on
    ``workers`` workers with one progress bar; ``log`` goes into the failure message."""
    import glob
    logs = glob.glob(os.path.join(str(directory), "slurm-*.out"))
    text = open(logs[0]).read() if logs else "(no job output)"
    assert code == 0, f"sbatch rc={code}: {job.output()}\n{text[-5000:]}\n{log}"
    finals = final_lines(text.splitlines())
    assert len(finals) == 1 and f"on {workers} workers" in finals[0], text[-3000:]
    assert text.count("val_accuracy") == 1, "one progress bar (rank 0's) expected"
