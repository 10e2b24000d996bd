"""``tfcs-run``'s command line: mpirun's and horovodrun's flags where they exist.

    tfcs-run -np 2 python train.py
    tfcs-run -np 4 -H node1:2,node2:2 -x NCCL_DEBUG=INFO python train.py
    tfcs-run -np 8 --hostfile hosts.txt --ssh-identity-file ~/.ssh/cluster python train.py
"""

from __future__ import annotations

import argparse
from typing import List, Optional

from ..errors import ConfigurationError
from . import hosts as hostlist

SURVIVOR_GRACE_S = 20.0  # first failure -> SIGTERM to the rest (they usually report and exit by themselves)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tfcs-run", description="Start N tf_commstrategy workers, on this machine or over ssh on others.",
        epilog="With Slurm, mpirun or Kubernetes, let the engine start the workers; see docs/launching.md")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of workers")
    p.add_argument("--backend", choices=["grpc", "nccl", "auto"], help="default backend (TFCS_BACKEND)")
    p.add_argument("--transport", choices=["auto", "shm", "unix", "tcp", "grpc"],
                   help="data path under the ring (TFCS_TRANSPORT; default auto: shared memory on one host, "
                        "raw TCP between hosts)")
    p.add_argument("--port", type=int, default=0, help="coordinator port (default: a free port)")
    p.add_argument("--host", help="one host only: the address the coordinator and workers bind (default "
                                  "127.0.0.1; sets TFCS_BIND_HOST for the workers)")
    p.add_argument("--timeout", type=float, help="collective deadline in seconds (TFCS_TIMEOUT)")
    p.add_argument("--start-timeout", type=float, metavar="S",
                   help="seconds the workers wait for each other to start (TFCS_RENDEZVOUS_TIMEOUT; "
                        "horovodrun's --start-timeout)")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output lines with [rank]")
    p.add_argument("--no-token", action="store_true",
                   help="do not generate a job token (insecure: any local process may then join the job)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="after a failure start all workers again, at most K times (default 0)")
    p.add_argument("--grace", type=float, default=SURVIVOR_GRACE_S,
                   help="seconds the other workers get to report a failure themselves before they are "
                        f"stopped (default {SURVIVOR_GRACE_S:g})")
    p.add_argument("--verbose", action="store_true",
                   help="say where each rank runs, and have the workers log at INFO (TFCS_LOG_LEVEL=INFO)")
    _add_host_options(p)
    _add_horovodrun_tuning(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program each worker runs")
    return p


def _add_horovodrun_tuning(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("horovodrun's tuning flags, accepted and not needed")
    g.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                   help="not needed: a step's gradients always travel in one fused collective")
    g.add_argument("--cycle-time-ms", type=float, metavar="MS",
                   help="not needed: collectives start when called, with no background cycle to wait for")


def tuning_notes(args) -> List[str]:
    """What ``tfcs-run`` says about horovodrun's tuning flags when they are given."""
    notes = []
    if args.fusion_threshold_mb is not None:
        notes.append("--fusion-threshold-mb is accepted and not needed: each step's gradients travel in one "
                     "fused collective, whatever their size")
    if args.cycle_time_ms is not None:
        notes.append("--cycle-time-ms is accepted and not needed: a collective starts when every rank calls it, "
                     "with no background cycle")
    return notes


def _add_host_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hosts (horovodrun / mpirun)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots, e.g. node1:2,node2:2; ranks fill them in order, rank 0's "
                            "host runs the coordinator; other machines than this one are reached over ssh")
    where.add_argument("--hostfile", metavar="FILE",
                       help="one host per line: 'host slots=N' (horovodrun, Open MPI), 'host:N' or 'host'")
    g.add_argument("-x", dest="export", action="append", default=[], metavar="NAME[=VALUE]",
                   help="set NAME (to VALUE, or to its value here) for every worker, as mpirun -x; "
                        "repeatable. Remote workers get this environment anyway, less shell- and "
                        "machine-specific variables")
    g.add_argument("-p", "--ssh-port", type=int, help="ssh port of the remote hosts")
    g.add_argument("-i", "--ssh-identity-file", metavar="FILE", help="ssh private key for the remote hosts")
    g.add_argument("--ssh-command", default="ssh", metavar="CMD",
                   help="the ssh program and its options, e.g. 'ssh -F cluster.conf' (default: ssh)")


def job_hosts(args) -> Optional[List[hostlist.Host]]:
    """The hosts of ``-H`` / ``--hostfile``; None when neither is given (every worker on this machine).

    Raises:
      ConfigurationError: the hosts cannot be read or parsed, or ``--host`` is given with them.
    """
    if args.hosts is None and args.hostfile is None:
        return None
    if args.host:
        raise ConfigurationError("--host applies to a job on this machine only; with -H / --hostfile the "
                                 "coordinator runs on the first host, under the name given there")
    if args.hosts is not None:
        return hostlist.parse_hosts(args.hosts)
    try:
        with open(args.hostfile) as f:
            return hostlist.parse_hostfile(f.read(), args.hostfile)
    except OSError as e:
        raise ConfigurationError(f"--hostfile {args.hostfile!r} cannot be read: {e}") from e


def exports(args, base: dict) -> dict:
    """``-x NAME=VALUE`` / ``-x NAME`` -> the variables to set for every worker.

    Raises:
      ConfigurationError: ``-x NAME`` names a variable that is not set here.
    """
    out = {}
    for item in args.export:
        name, sep, value = item.partition("=")
        if not sep:
            if name not in base:
                raise ConfigurationError(f"-x {name}: {name} is not set here; write -x {name}=VALUE")
            value = base[name]
        out[name] = value
    return out
