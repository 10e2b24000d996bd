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
