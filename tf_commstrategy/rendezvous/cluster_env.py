"""Where a worker learns its rank, the world size, its local rank and the coordinator's address.

Sources, first match wins (each field given explicitly always overrides):

1. explicit arguments to :func:`tf_commstrategy.init`;
2. ``TFCS_RANK``, ``TFCS_WORLD_SIZE``, ``TFCS_LOCAL_RANK``, ``TFCS_COORDINATOR`` (``tfcs-run`` sets these);
3. ``TF_CONFIG`` (Kubernetes / Kubeflow TFJob): ranks are chief (or ``master``) first, then workers in order; the
   chief (or worker 0) hosts the coordinator on its own cluster-spec address;
4. horovodrun's Gloo mode (``HOROVOD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``; ``HOROVOD_LOCAL_SIZE`` and
   ``HOROVOD_CROSS_RANK`` / ``_SIZE`` are checked for consistency, the rendezvous counts them itself):
   coordinator from ``TFCS_COORDINATOR`` or ``MASTER_ADDR``/``MASTER_PORT``. horovodrun's
   ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` / ``_PORT`` name its own rendezvous server on the launching host (that
   port is taken, and rank 0 need not run there), so they are not used;
5. Open MPI (``OMPI_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``): coordinator from ``TFCS_COORDINATOR``
   or ``MASTER_ADDR``/``MASTER_PORT`` (mpirun knows no host to use);
6. MVAPICH2 (``MV2_COMM_WORLD_RANK`` / ``_SIZE`` / ``_LOCAL_RANK``), then MPICH and Intel MPI
   (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``): coordinator as for Open MPI;
7. torchrun style ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
8. Slurm (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``): coordinator on the first host of
   the step (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``), port ``TFCS_COORDINATOR_PORT`` or
   ``29400 + (37 * SLURM_JOB_ID + SLURM_STEP_ID) % 1000``.

Launchers that start the processes themselves (4-7) come before Slurm, whose variables their
processes inherit inside an allocation. When srun itself started the processes and an MPI source
matched without a coordinator, Slurm's coordinator is used if Slurm agrees on rank and size.

Nothing found means a single process (rank 0 of 1), which needs no coordinator.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Mapping, Optional

from .. import config
from ..errors import ConfigurationError

DEFAULT_SLURM_BASE_PORT = 29400


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Who this worker is in the job, and where the coordinator is.

    Attributes:
      rank: this worker's rank, 0..world_size-1.
      world_size: number of workers.
      local_rank: index among the workers on this host; None when no source gives it (the
        rendezvous then derives it from the hostnames).
      coordinator: rank 0's "host:port"; None only for a world of one.
      source: which source supplied rank and size ("TFCS_*", "TF_CONFIG", "Slurm", ...).
    """

    rank: int
    world_size: int
    local_rank: Optional[int]  # None: derived from the hostnames during the rendezvous
    coordinator: Optional[str]  # "host:port"; None only when world_size == 1
    source: str                 # which source supplied rank / size, for logs and errors

    def validate(self) -> "ClusterSpec":
        """Check the fields against each other.

        Returns:
          ``self``.

        Raises:
          ConfigurationError: world size < 1, rank out of range, negative local rank, or no valid
            coordinator address for a job of more than one worker.
        """
        if self.world_size < 1:
            raise ConfigurationError(f"world size is {self.world_size} (from {self.source})",
                                     fix="world size must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigurationError(
                f"rank {self.rank} is outside [0, {self.world_size}) (from {self.source})",
                fix="give each worker a distinct rank in 0..world_size-1")
        if self.local_rank is not None and self.local_rank < 0:
            raise ConfigurationError(f"local rank is {self.local_rank} (from {self.source})",
                                     fix="local rank must be >= 0")
        if self.world_size > 1:
            if not self.coordinator:
                raise ConfigurationError(
                    f"no coordinator address for a job of {self.world_size} workers (from {self.source})",
                    fix="set TFCS_COORDINATOR=host:port (the host of rank 0) or pass coordinator= to init()")
            split_host_port(self.coordinator)
        return self


def split_host_port(address: str):
    """'host:port' / '[v6]:port' -> (host, port) with a clear error.

    Args:
      address: "host:port" or "[v6 address]:port".

    Returns:
      ``(host, port)``.

    Raises:
      ConfigurationError: not host:port, or the port is outside 1..65535.
    """
    m = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", str(address).strip())
    if not m:
        raise ConfigurationError(f"coordinator address {address!r} is not host:port",
                                 fix="write it as host:port, e.g. 10.0.0.1:29400")
    port = int(m.group(2))
    if not 0 < port < 65536:
        raise ConfigurationError(f"port {port} in {address!r} is out of range", fix="use a port in 1..65535")
    return m.group(1), port


def join_host_port(host: str, port: int) -> str:
    """(host, port) -> 'host:port', with an IPv6 address in brackets ('[::1]:80').

    Args:
      host: a hostname, IPv4 or IPv6 address.
      port: the port.

    Returns:
      The address text that ``split_host_port`` and gRPC read back.
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm nodelist: 'gpu[03-05,9],cpu1' -> 'gpu03', 'rack[1-2]-n[01-04]' -> 'rack1-n01'.

    The first comma-separated entry outside brackets, with each bracket group replaced by the first
    value of its first range (zero padding kept), and the text between and after the groups kept.

    Args:
      nodelist: ``SLURM_JOB_NODELIST``.

    Returns:
      The first host name.

    Raises:
      ConfigurationError: the list cannot be parsed.
    """
    text = nodelist.strip()
    depth, end, balanced = 0, len(text), True
    for i, ch in enumerate(text):
        if ch == "," and depth == 0:
            end = i
            break
        depth += {"[": 1, "]": -1}.get(ch, 0)
        balanced = balanced and depth in (0, 1)
    entry = text[:end]
    host = re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0].strip(), entry)
    if not balanced or depth != 0 or not host or re.search(r"[\[\],\s]", host):
        raise ConfigurationError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}",
                                 fix="set TFCS_COORDINATOR=host:port explicitly")
    return host


def _int(env, name):
    try:
        return int(env[name])
    except ValueError:
        raise ConfigurationError(f"environment variable {name}={env[name]!r} is not an integer",
                                 fix=f"set {name} to an integer or unset it") from None


def _from_tfcs(env):
    found = config.tfcs_cluster_from_env(env)
    return None if found is None else (*found, None, "TFCS_*")


def _from_tf_config(env):
    raw = env.get("TF_CONFIG")
    if not raw:
        return None
    try:
        cfg = json.loads(raw)
        cluster, task = cfg["cluster"], cfg["task"]
        ttype, tindex = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigurationError(f"TF_CONFIG cannot be parsed ({e}): {raw[:200]!r}",
                                 fix='TF_CONFIG must hold {"cluster": {...}, "task": {"type": ..., "index": ...}}'
                                 ) from None
    if not isinstance(cluster, dict):
        raise ConfigurationError(f"TF_CONFIG's cluster is not a mapping: {raw[:200]!r}",
                                 fix='write it as {"chief": [...], "worker": [...]}')
    # "master" is the older name of the chief (TF 1 / Estimator configurations)
    chiefs = list(cluster.get("chief", [])) + list(cluster.get("master", []))
    ttype = "chief" if ttype == "master" else ttype
    members = [("chief", a) for a in chiefs] + [("worker", a) for a in cluster.get("worker", [])]
    if ttype not in ("chief", "worker"):
        raise ConfigurationError(f"TF_CONFIG task type {ttype!r} takes no part in training",
                                 fix="tf_commstrategy runs on 'chief' and 'worker' tasks only; do not start it on "
                                     "'ps' or 'evaluator' tasks")
    of_type = len(chiefs) if ttype == "chief" else len(cluster.get("worker", []))
    if len(chiefs) > 1:
        raise ConfigurationError(f"TF_CONFIG lists {len(chiefs)} chief/master tasks",
                                 fix="a cluster has at most one chief; list the others as workers")
    if not 0 <= tindex < of_type:
        raise ConfigurationError(f"TF_CONFIG task {ttype}:{tindex} is not in the cluster spec ({of_type} "
                                 f"{ttype} task(s))", fix="check the task index against cluster." + ttype)
    rank = (len(chiefs) if ttype == "worker" else 0) + tindex
    my_host = split_host_port(members[rank][1])[0]
    local_rank = sum(1 for _, a in members[:rank] if split_host_port(a)[0] == my_host)
    return rank, len(members), local_rank, members[0][1], "TF_CONFIG"


def _from_slurm(env):
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    coord = None
    # rank 0 runs on the first node of its job step, which need not be the allocation's first node
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodes:
        host = first_slurm_host(nodes)
        port = config.coordinator_port_from_env(env)
        if port is None and env.get("MASTER_PORT"):
            port = _int(env, "MASTER_PORT")
        elif port is None:  # steps of one allocation running at once get different ports; so do consecutive
            # jobs' steps (job J step s+1 and job J+1 step s, which (job + step) would have put on one port)
            job = _int(env, "SLURM_JOB_ID") if env.get("SLURM_JOB_ID") else 0
            step = _int(env, "SLURM_STEP_ID") if env.get("SLURM_STEP_ID", "").isdigit() else 0
            port = DEFAULT_SLURM_BASE_PORT + (37 * job + step) % 1000
        coord = join_host_port(host, port)
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else None
    return _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), local, coord, "Slurm"


def _master(env):
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT')}"
    return None


def _from_horovod(env):
    # horovodrun's Gloo mode (gloo_run.create_slot_env_vars); Horovod itself reads HOROVOD_RANK before the MPI
    # variables, and so does this source
    if "HOROVOD_RANK" not in env or "HOROVOD_SIZE" not in env:
        return None
    for index_v, count_v in (("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
                             ("HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")):
        if index_v in env and count_v in env and not 0 <= _int(env, index_v) < _int(env, count_v):
            raise ConfigurationError(f"{index_v}={env[index_v]!r} is outside [0, {count_v}={env[count_v]!r})",
                                     fix="start the job with horovodrun, or set both consistently")
    local = _int(env, "HOROVOD_LOCAL_RANK") if "HOROVOD_LOCAL_RANK" in env else None
    return _int(env, "HOROVOD_RANK"), _int(env, "HOROVOD_SIZE"), local, _master(env), "Horovod (horovodrun)"


def _from_ompi(env):
    if "OMPI_COMM_WORLD_RANK" not in env or "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK") if "OMPI_COMM_WORLD_LOCAL_RANK" in env else None
    return _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE"), local, _master(env), "Open MPI"


def _from_pmi(env):
    # MPICH / Intel MPI (Hydra: PMI_RANK, PMI_SIZE, MPI_LOCALRANKID) and MVAPICH2 (MV2_COMM_WORLD_*)
    for rank_v, size_v, local_v, name in (("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                                           "MVAPICH"),
                                          ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPICH/Intel MPI (PMI)")):
        if rank_v in env and size_v in env:
            local = _int(env, local_v) if local_v in env else None
            return _int(env, rank_v), _int(env, size_v), local, _master(env), name
    return None


def _from_torchrun(env):
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    local = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else None
    return _int(env, "RANK"), _int(env, "WORLD_SIZE"), local, _master(env), "torchrun-style RANK/WORLD_SIZE"


# Launchers that start the processes themselves come before Slurm: mpirun, mpiexec or torchrun run
# inside a Slurm allocation, and their processes inherit the SLURM_PROCID of the batch step or of
# the srun that started the launcher's daemons, which is not their rank.
_SOURCES = (_from_tfcs, _from_tf_config, _from_horovod, _from_ompi, _from_pmi, _from_torchrun, _from_slurm)


def resolve_cluster(rank: Optional[int] = None, world_size: Optional[int] = None,
                    local_rank: Optional[int] = None, coordinator: Optional[str] = None,
                    environ: Optional[Mapping[str, str]] = None) -> ClusterSpec:
    """Combine explicit arguments with the first environment source that defines a rank.

    Sources, first match wins: ``TFCS_*``, ``TF_CONFIG``, horovodrun's ``HOROVOD_*``, Open MPI, MVAPICH /
    MPICH / Intel MPI, torchrun-style variables, Slurm; none means a single process. ``TFCS_COORDINATOR`` overrides the coordinator of any source.

    Args:
      rank: overrides the environment's rank (give ``world_size`` too).
      world_size: overrides the environment's world size.
      local_rank: overrides the environment's local rank.
      coordinator: overrides the coordinator address ("host:port").
      environ: the variables to read (default: ``os.environ``); lets tests simulate an engine.

    Returns:
      The validated ``ClusterSpec``.

    Raises:
      ConfigurationError: a variable cannot be parsed, or the result is inconsistent.
    """
    env = os.environ if environ is None else environ
    found = None
    for source in _SOURCES:
        found = source(env)
        if found is not None:
            break
    if found is None:
        found = (0, 1, None, None, "default (single process)")  # local rank 0 only if alone (below)
    src_rank, src_size, src_local, src_coord, source = found
    if src_coord is None and source != "Slurm":
        # srun started these processes itself (srun --mpi=pmi2 / pmix sets the MPI variables too): the
        # Slurm variables then agree on rank and size and know the coordinator's host
        slurm = _from_slurm(env)
        if slurm is not None and slurm[:2] == (src_rank, src_size):
            src_coord = slurm[3]
    explicit = rank is not None or world_size is not None
    if explicit and (rank is None or world_size is None) and source.startswith("default"):
        raise ConfigurationError("init() got only one of rank= and world_size=",
                                 fix="pass both, or neither (then they come from the environment)")
    r = src_rank if rank is None else int(rank)
    n = src_size if world_size is None else int(world_size)
    # None: not given by any source; the rendezvous then counts the ranks on the same host.
    # An explicit rank numbers the workers its own way: the environment's local rank belongs to another
    # numbering (Slurm's, say) and is not trusted then.
    lr = local_rank if local_rank is not None else (None if rank is not None else src_local)
    if lr is None and n == 1:
        lr = 0
    coord = coordinator or config.coordinator_from_env(env) or src_coord
    if explicit:
        source = "init() arguments" if rank is not None and world_size is not None else source
    return ClusterSpec(rank=r, world_size=n, local_rank=None if lr is None else int(lr), coordinator=coord, source=source).validate()
