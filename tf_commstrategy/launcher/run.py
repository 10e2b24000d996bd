"""``tfcs-run``: start N workers, on this machine or over ssh on several hosts, each with its ``TFCS_*``
environment.

    tfcs-run -np 2 python train.py --epochs 3
    tfcs-run -np 4 -H node1:2,node2:2 python train.py
    python -m tf_commstrategy.run -np 4 --backend grpc --timeout 120 python bench.py

Hosts and rank placement are ``hosts``'s, the command line ``options``'s, remote workers ``remote``'s.
Every output line of a worker is prefixed with ``[rank]``. When a worker fails, the others get
``--grace`` seconds to notice and report it themselves (they raise ``PeerLostError`` naming it), then
they are stopped (SIGTERM, then SIGKILL after a grace period; each worker runs in its own process
group, so its children go too) and ``tfcs-run`` exits with the first failing worker's code (128 +
signal when it was killed), naming its rank. When the job ends, successfully or not, whatever is left in
the workers' process groups (processes a worker started and did not wait for) is stopped as well.
With ``--max-restarts K`` the whole job is started again after a failure, up to K times (workers see
``TFCS_RESTART_COUNT``; with ``tf_keras.callbacks.BackupAndRestore`` training resumes from the last
finished epoch). SIGINT / SIGTERM / SIGHUP sent to ``tfcs-run`` are forwarded to every worker and
end the job without restarts; workers still running ``GRACE_S`` seconds later are stopped (SIGTERM,
then SIGKILL), and a second signal kills them at once. If ``tfcs-run`` itself dies, even by SIGKILL,
every worker gets SIGTERM (Linux: ``PR_SET_PDEATHSIG``, set before the worker's program starts; a
remote worker when its ssh connection ends). Output sent to a closed reader (``tfcs-run ... | head``)
is discarded, so workers never block writing it.
"""

from __future__ import annotations

import dataclasses
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

from ..errors import ConfigurationError
from ..rendezvous.cluster_env import join_host_port
from ..rendezvous.rendezvous import is_loopback
from . import hosts as hostlist
from . import shims
from .options import build_parser, exports, job_hosts, tuning_notes
from .remote import RemoteWorker, forwarded_env, ssh_argv

GRACE_S = 10.0          # SIGTERM -> SIGKILL
SSH_FAILED = 255        # ssh's own exit code: the connection failed or was lost


def _ephemeral_range() -> Tuple[int, int]:
    """The ports the kernel hands out to unbound sockets (Linux; a common default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _free_port(host: str = "127.0.0.1") -> int:
    """A port free now and outside the ephemeral range: rank 0 binds it seconds later, after its
    imports, and meanwhile the other workers keep dialling it; a port the kernel may give to an
    outgoing connection (theirs included) could be taken in between."""
    lo, hi = _ephemeral_range()
    candidates = list(range(20000, lo)) if lo > 21000 else list(range(hi + 1, 65536))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket(family) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:  # everything tried is in use: let the kernel choose
        s.bind((host, 0))
        return s.getsockname()[1]


def _worker_argv(command: List[str]) -> List[str]:
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-E", "-c", shims.DEATH_SIGNAL, str(os.getpid())] + list(command)


@dataclasses.dataclass
class Plan:
    """Where the job's ranks run: ``slots[r]`` is rank r's place, ``remote[host]`` tells whether a host
    is reached over ssh, and the coordinator listens on ``coordinator_host`` (rank 0's host)."""

    slots: List[hostlist.Slot]
    remote: Dict[str, bool]
    coordinator_host: str

    @property
    def multi_host(self) -> bool:
        return len(self.remote) > 1 or any(self.remote.values())

    def label(self, rank: int) -> str:
        return f"rank {rank} on {self.slots[rank].host}" if self.multi_host else f"rank {rank}"


def make_plan(args) -> Plan:
    """The job's ``Plan`` from ``-np``, ``--host`` and ``-H`` / ``--hostfile``.

    Raises:
      ConfigurationError: the hosts are malformed or too few for ``-np``, or rank 0's host is a loopback
        name while other hosts must reach it.
    """
    hosts = job_hosts(args)
    if hosts is None:
        host = args.host or "127.0.0.1"
        return Plan([hostlist.Slot(r, host, r, args.np) for r in range(args.np)], {host: False}, host)
    slots = hostlist.place(hosts, args.np)
    remote = {h: not hostlist.is_local(h) for h in dict.fromkeys(s.host for s in slots)}
    first = slots[0].host
    if any(remote.values()) and not remote[first] and is_loopback_name(first):
        raise ConfigurationError(
            f"rank 0 runs on {first!r}, a loopback name that the other hosts cannot reach; name this machine "
            "in -H / --hostfile by its hostname or an address the other hosts can reach")
    return Plan(slots, remote, first)


def is_loopback_name(host: str) -> bool:
    return host == "localhost" or is_loopback(host)


def _coordinator_port(args, plan: Plan) -> int:
    """``--port``; else a free port here when rank 0 runs here; else a port outside the ephemeral range,
    unchecked (the first host cannot be asked)."""
    if args.port:
        return args.port
    if not plan.remote[plan.coordinator_host]:
        return _free_port(plan.coordinator_host)
    lo, hi = _ephemeral_range()
    return random.randrange(20000, lo) if lo > 21000 else random.randrange(hi + 1, 65536)


def worker_env(base: dict, slot: hostlist.Slot, n: int, coordinator: str, args, restart: int = 0) -> dict:
    """The environment of the worker in ``slot``: ``base``, then ``-x`` variables, then the job's own."""
    env = dict(base)
    env.update(exports(args, base))
    env.update({"TFCS_RANK": str(slot.rank), "TFCS_WORLD_SIZE": str(n), "TFCS_LOCAL_RANK": str(slot.local_rank),
                "TFCS_COORDINATOR": coordinator, "PYTHONUNBUFFERED": "1",
                "TFCS_RESTART_COUNT": str(restart)})
    if args.start_timeout:
        env["TFCS_RENDEZVOUS_TIMEOUT"] = str(args.start_timeout)
    if args.backend:
        env["TFCS_BACKEND"] = args.backend
    if args.timeout:
        env["TFCS_TIMEOUT"] = str(args.timeout)
    if args.transport:
        env["TFCS_TRANSPORT"] = args.transport
    if args.host:  # an explicit --host beats an inherited TFCS_BIND_HOST
        env["TFCS_BIND_HOST"] = args.host
    return env


def _pump(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    """Copy a worker's output, line by line, until it closes; once our reader is gone (a closed pipe),
    keep reading and discard, so the worker never blocks on a full pipe."""
    broken = False
    for line in iter(stream.readline, b""):
        if broken:
            continue
        with lock:
            try:
                out.buffer.write(prefix + line if prefix else line)
                out.buffer.flush()
            except (OSError, ValueError):  # BrokenPipeError, or our stream closed
                broken = True
    stream.close()


def _say(text: str) -> None:
    """A message of tfcs-run's own on stderr; a closed stderr must not end the launcher early."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP / SIGTSTP; state T in /proc), Linux only."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _group_is_ours(p: subprocess.Popen) -> bool:
    """False when the worker was reaped and its pid is in use again: the kernel reuses no pid that
    still names a process group with members, so the worker's group is empty and a group of that
    number now is somebody else's."""
    if p.poll() is None:
        return True
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Job:
    """The workers of one attempt: ``procs[r]`` is rank r's local process (the worker itself, or its ssh
    connection when ``remote[r]`` names a ``RemoteWorker``)."""

    def __init__(self, procs: List[subprocess.Popen], remote: Optional[Dict[int, RemoteWorker]] = None,
                 plan: Optional[Plan] = None):
        self.procs = procs
        self.remote = remote if remote is not None else {}
        self.plan = plan
        self.stopping = False

    def name(self, rank: int) -> str:
        """``rank 2``, or ``rank 2 on node2`` in a job on several hosts."""
        return self.plan.label(rank) if self.plan is not None else f"rank {rank}"

    def outcome(self, rank: int, code: Optional[int]) -> str:
        """How rank ``rank`` ended; ``name`` already says on which host."""
        if rank in self.remote and code == SSH_FAILED:
            return (f"lost its ssh connection (ssh exited with code {SSH_FAILED}: the host went down or out of "
                    "reach, or refused the login)")
        return _describe(code)

    def signal_all(self, sig: int, groups: bool = False) -> None:
        """Send ``sig`` to the process group of every running worker (``groups``: of every worker, also
        those that exited: what they started may still run there; a remote worker's host sees to that)."""
        for rank, p in enumerate(self.procs):
            if rank in self.remote:
                self.remote[rank].send_signal(sig)
                continue
            if not _group_is_ours(p):
                continue
            if groups or p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def _groups_alive(self) -> bool:
        for p in self.procs:
            if not _group_is_ours(p):
                continue
            try:
                os.killpg(p.pid, 0)
                return True
            except (ProcessLookupError, PermissionError):
                continue
        return False

    def stop(self, grace: float = GRACE_S) -> None:
        """SIGTERM to every worker's process group, SIGKILL to what is left after ``grace`` seconds."""
        self.stopping = True
        self.signal_all(signal.SIGTERM, groups=True)
        self.signal_all(signal.SIGCONT, groups=True)  # a stopped (SIGSTOP) worker handles SIGTERM once continued
        end = time.monotonic() + grace
        while time.monotonic() < end and (any(p.poll() is None for p in self.procs) or self._groups_alive()):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL, groups=True)
        for rank, p in enumerate(self.procs):
            if rank in self.remote:
                self.remote[rank].close(timeout=GRACE_S)
                continue
            try:
                p.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:  # unkillable (uninterruptible sleep in the kernel)
                _say(f"tfcs-run: worker pid {p.pid} does not exit even after SIGKILL; leaving it")


def run(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.np < 1 or args.max_restarts < 0 or args.grace < 0:
        print("tfcs-run: -np must be >= 1, --max-restarts and --grace >= 0", file=sys.stderr)
        return 2
    if not command:
        print("tfcs-run: no command given (e.g. tfcs-run -np 2 python train.py)", file=sys.stderr)
        return 2
    base = dict(os.environ)
    try:
        plan = make_plan(args)
        exports(args, base)
    except ConfigurationError as e:
        print(f"tfcs-run: {e}", file=sys.stderr)
        return 2
    if not args.no_token:
        base.setdefault("TFCS_TOKEN", secrets.token_hex(16))
    for note in tuning_notes(args):
        _say(f"tfcs-run: {note}")
    if args.verbose:
        base["TFCS_LOG_LEVEL"] = "INFO"
        _say(f"tfcs-run: {args.np} workers: " + "; ".join(
            f"rank {s.rank} on {s.host} (local rank {s.local_rank} of {s.local_size}"
            f"{', over ssh' if plan.remote[s.host] else ''})" for s in plan.slots))
    received: List[int] = []

    def forward(signum, _frame):
        received.append(signum)
        if job_box:  # the first signal is the workers' to handle; a second one kills them
            job_box[0].signal_all(signum if len(received) == 1 else signal.SIGKILL, groups=len(received) > 1)

    job_box: List[Job] = []
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for attempt in range(args.max_restarts + 1):
            code = _run_once(args, plan, command, base, attempt, job_box, received)
            if code == 0 or received:
                break
            if attempt < args.max_restarts:
                _say(f"tfcs-run: restarting all {args.np} workers (restart {attempt + 1} of "
                     f"{args.max_restarts})")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if received:  # the job was ended by this signal (workers killed at the end of its grace included)
        code = 128 + received[0]
    return code


def _run_once(args, plan: Plan, command, base: dict, attempt: int, job_box: list, received: list) -> int:
    """Start the workers once and wait for them; returns the job's exit code."""
    if (not all(plan.remote.values()) and os.sep not in command[0]
            and shutil.which(command[0], path=base.get("PATH")) is None):
        _say(f"tfcs-run: cannot start {command[0]!r}: not found on PATH")
        return 127
    coordinator = join_host_port(plan.coordinator_host, _coordinator_port(args, plan))
    procs, threads = [], []
    exits: List[Tuple[int, int]] = []  # (rank, code) in the order the workers exited
    exits_lock = threading.Lock()

    def wait_for(rank: int, p: subprocess.Popen) -> None:
        code = p.wait()
        with exits_lock:
            exits.append((rank, code))

    job = Job(procs, plan=plan)
    job_box[:] = [job]
    if not _start_workers(args, plan, command, base, attempt, coordinator, job, threads, wait_for):
        return 127
    exit_code = 0
    signalled_at = None
    try:
        while True:
            if received and signalled_at is None:
                signalled_at = time.monotonic()
            if signalled_at is not None and time.monotonic() - signalled_at > GRACE_S:
                _say(f"tfcs-run: workers still running {GRACE_S:g} s after the signal; stopping them")
                job.stop(grace=2.0)
            with exits_lock:
                done = list(exits)
            failed = [(r, c) for r, c in done if c != 0]
            if failed:
                rank, code = failed[0]  # the first to exit with an error, not the lowest rank
                exit_code = 128 - code if code < 0 else code
                if received:
                    job.stop()
                    break
                _stop_after_failure(args, job, rank, code, received)
                break
            if len(done) == len(procs):
                break
            time.sleep(0.05)
    finally:
        job.stop(grace=2.0)  # what the workers left in their groups (and all of them, on an exception here)
        end = time.monotonic() + 5.0  # output still buffered; a pipe a worker's child holds open is left
        for t in threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        _remove_segments_of({p.pid for p in procs})
    return exit_code


def _start_workers(args, plan: Plan, command, base: dict, attempt: int, coordinator: str, job: Job,
                   threads: list, wait_for) -> bool:
    """Start the ``args.np`` workers into ``job.procs``, each with threads that pump its output.

    Every worker's stdout and stderr go through ``_pump`` threads (appended to ``threads``) that prefix
    its lines with its rank; ``wait_for(rank, proc)`` runs in a thread of its own and records its exit.
    A worker that cannot start stops those already started; the result is then False.
    """
    lock = threading.Lock()
    for slot in plan.slots:
        env = worker_env(base, slot, args.np, coordinator, args, restart=attempt)
        try:
            p = _start_one(args, plan, slot, command, env, job)
        except OSError as e:
            _say(f"tfcs-run: cannot start {job.name(slot.rank)}: {e}")
            job.stop(grace=2.0)
            return False
        job.procs.append(p)
        prefix = b"" if args.no_prefix else f"[{slot.rank}] ".encode()
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            threads.append(threading.Thread(target=_pump, args=(stream, out, prefix, lock), daemon=True))
            threads[-1].start()
        threading.Thread(target=wait_for, args=(slot.rank, p), daemon=True).start()
    return True


def _start_one(args, plan: Plan, slot: hostlist.Slot, command, env: dict, job: Job) -> subprocess.Popen:
    """Start the worker of ``slot``: here, or on its host over ssh (recorded in ``job.remote``)."""
    if not plan.remote[slot.host]:
        return subprocess.Popen(_worker_argv(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    ssh = ssh_argv(slot.host, args.ssh_command, args.ssh_port, args.ssh_identity_file)
    worker = RemoteWorker.start(slot.host, command, forwarded_env(env), GRACE_S, ssh)
    job.remote[slot.rank] = worker
    return worker.proc


def _stop_after_failure(args, job: Job, rank: int, code: int, received: list) -> None:
    """After rank ``rank`` failed with ``code``: give the others ``--grace`` seconds, stop them, report.

    The grace period ends early on a signal to ``tfcs-run`` or once every worker left has exited or is
    stopped (SIGSTOP: it reports nothing by itself); the report names every rank's outcome.
    """
    procs = job.procs
    _say(f"tfcs-run: {job.name(rank)} (pid {procs[rank].pid}) {job.outcome(rank, code)}; giving the other "
         f"workers {args.grace:g} s to stop")
    end = time.monotonic() + args.grace
    while time.monotonic() < end and not received:
        alive = [p for p in procs if p.poll() is None]
        if not alive or all(_is_stopped(p.pid) for p in alive):
            break  # stopped workers will not report anything themselves
        time.sleep(0.05)
    stopped = {r for r, p in enumerate(procs) if p.poll() is None and _is_stopped(p.pid)}
    for r in sorted(stopped):
        _say(f"tfcs-run: {job.name(r)} (pid {procs[r].pid}) is stopped (SIGSTOP?) and will be killed")
    job.stop()
    others = [f"{job.name(r)} {job.outcome(r, p.returncode)}" for r, p in enumerate(procs) if r != rank]
    _say(f"tfcs-run: job failed: {job.name(rank)} {job.outcome(rank, code)} (first failure); " + "; ".join(others))


def _remove_segments_of(pids) -> None:
    """Shared-memory segments are unlinked by the workers once mapped; a worker killed during that
    window leaves one behind, which is removed here once the job is over (with every other segment of
    this user whose creator is dead)."""
    try:
        from ..core.shared_memory import remove_stale_segments
        # the workers' own segments, then those of any process that died (a worker behind a shell
        # or a wrapper script creates its segments under its own pid, not the one tfcs-run knows)
        n = remove_stale_segments(only_pids=set(pids)) + remove_stale_segments()
    except Exception:  # pragma: no cover - cleanup must never hide the job's own exit code
        return
    if n:
        _say(f"tfcs-run: removed {n} shared-memory segment(s) left by the workers")


def main(argv: Optional[List[str]] = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
