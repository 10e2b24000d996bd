import json

import pytest

from tf_commstrategy.errors import ConfigurationError
from tf_commstrategy.rendezvous.cluster_env import first_slurm_host, join_host_port, resolve_cluster, split_host_port


def test_nothing_set_is_a_single_process():
    s = resolve_cluster(environ={})
    assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (0, 1, 0, None)


def test_tfcs_variables():
    s = resolve_cluster(environ={"TFCS_RANK": "2", "TFCS_WORLD_SIZE": "4", "TFCS_LOCAL_RANK": "0",
                                 "TFCS_COORDINATOR": "10.1.2.3:2222"})
    assert (s.rank, s.world_size, s.local_rank, s.coordinator, s.source) == (2, 4, 0, "10.1.2.3:2222", "TFCS_*")


def test_explicit_arguments_override_environment():
    env = {"TFCS_RANK": "2", "TFCS_WORLD_SIZE": "4", "TFCS_COORDINATOR": "a:1"}
    s = resolve_cluster(rank=1, world_size=3, coordinator="b:2", environ=env)
    assert (s.rank, s.world_size, s.coordinator) == (1, 3, "b:2")


def test_tfcs_beats_tf_config_and_slurm():
    env = {"TFCS_RANK": "1", "TFCS_WORLD_SIZE": "2", "TFCS_COORDINATOR": "h:1",
           "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
           "TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}})}
    assert resolve_cluster(environ=env).rank == 1


def test_tf_config_chief_first_then_workers():
    cluster = {"chief": ["c0:2222"], "worker": ["w0:2222", "w1:2222", "w1:2223"]}
    for ttype, idx, want_rank, want_local in [("chief", 0, 0, 0), ("worker", 0, 1, 0), ("worker", 2, 3, 1)]:
        env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": ttype, "index": idx}})}
        s = resolve_cluster(environ=env)
        assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (want_rank, 4, want_local, "c0:2222")


def test_tf_config_without_chief_uses_worker0():
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["w0:1", "w1:1"]}, "task": {"type": "worker", "index": 1}})}
    s = resolve_cluster(environ=env)
    assert (s.rank, s.world_size, s.coordinator) == (1, 2, "w0:1")


def test_tf_config_ps_task_is_rejected():
    env = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["w0:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}})}
    with pytest.raises(ConfigurationError, match="'ps' takes no part"):
        resolve_cluster(environ=env)


def test_tf_config_malformed():
    with pytest.raises(ConfigurationError, match="TF_CONFIG cannot be parsed"):
        resolve_cluster(environ={"TF_CONFIG": "{not json"})


@pytest.mark.parametrize("nodelist,first", [("node01", "node01"), ("gpu[03-05,9]", "gpu03"),
                                            ("a[7],b[1-2]", "a7"), ("host-1,host-2", "host-1"),
                                            ("rack[1-2]-node[01-04]", "rack1-node01"), ("node[1-2]-ib", "node1-ib"),
                                            ("gpu[003-004],cpu[1-2]-x", "gpu003")])
def test_slurm_nodelist_first_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["n[1-2", "n]1[", "", "n[[1]]"])
def test_slurm_nodelist_that_cannot_be_parsed(nodelist):
    with pytest.raises(ConfigurationError, match="TFCS_COORDINATOR"):
        first_slurm_host(nodelist)


_SLURM_STEP = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n[1-2]",
               "SLURM_JOB_ID": "7"}


def test_mpirun_inside_a_slurm_allocation_takes_the_mpi_rank():
    # the processes inherit the batch step's SLURM_PROCID; mpirun's own variables are their rank
    env = dict(_SLURM_STEP, OMPI_COMM_WORLD_RANK="3", OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1",
               MASTER_ADDR="n1", MASTER_PORT="5000")
    s = resolve_cluster(environ=env)
    assert (s.rank, s.world_size, s.local_rank, s.coordinator, s.source) == (3, 4, 1, "n1:5000", "Open MPI")


def test_torchrun_under_srun_takes_torchruns_rank():
    # srun -N2 torchrun --nproc-per-node 4: SLURM_PROCID is the node's torchrun, RANK the worker
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]", "RANK": "6", "WORLD_SIZE": "8",
           "LOCAL_RANK": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29500"}
    s = resolve_cluster(environ=env)
    assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (6, 8, 2, "n1:29500")


@pytest.mark.parametrize("mpi", [{"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"},
                                 {"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4",
                                  "MV2_COMM_WORLD_LOCAL_RANK": "1"}])
def test_mpich_intel_mpi_and_mvapich_ranks(mpi):
    with pytest.raises(ConfigurationError, match="TFCS_COORDINATOR"):  # mpiexec knows no host to use
        resolve_cluster(environ=mpi)
    s = resolve_cluster(environ=dict(mpi, TFCS_COORDINATOR="head:5000"))
    assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (3, 4, 1, "head:5000")


def test_srun_with_pmi_uses_slurms_coordinator_when_slurm_agrees():
    env = dict(_SLURM_STEP, SLURM_PROCID="3", SLURM_LOCALID="1", PMI_RANK="3", PMI_SIZE="4")
    s = resolve_cluster(environ=env)
    assert (s.rank, s.world_size, s.coordinator) == (3, 4, "n1:29659")
    # Slurm disagrees (mpiexec inside an allocation): its host is not this job's rank 0
    with pytest.raises(ConfigurationError, match="TFCS_COORDINATOR"):
        resolve_cluster(environ=dict(env, SLURM_PROCID="0"))


def test_slurm_variables_and_port():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n[10-13]",
           "SLURM_JOB_ID": "123456"}
    s = resolve_cluster(environ=env)
    assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (3, 8, 1, "n10:30272")
    env["TFCS_COORDINATOR_PORT"] = "4000"
    assert resolve_cluster(environ=env).coordinator == "n10:4000"


def test_open_mpi_needs_a_coordinator():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    with pytest.raises(ConfigurationError, match="TFCS_COORDINATOR"):
        resolve_cluster(environ=env)
    env["TFCS_COORDINATOR"] = "head:5000"
    s = resolve_cluster(environ=env)
    assert (s.rank, s.world_size, s.local_rank, s.coordinator, s.source) == (1, 2, 1, "head:5000", "Open MPI")


def test_torchrun_style():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "m", "MASTER_PORT": "29500"}
    s = resolve_cluster(environ=env)
    assert (s.rank, s.world_size, s.coordinator) == (0, 2, "m:29500")


def test_explicit_ranks_without_an_engine_leave_the_local_rank_to_the_rendezvous():
    # init(rank=1, world_size=2, coordinator=...) with nothing in the environment: not local rank 0 on every rank
    s = resolve_cluster(rank=1, world_size=2, coordinator="127.0.0.1:5000", environ={})
    assert (s.rank, s.world_size, s.local_rank) == (1, 2, None)
    assert resolve_cluster(rank=0, world_size=1, environ={}).local_rank == 0  # alone: 0


def test_an_explicit_rank_does_not_take_the_engines_local_rank():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n[1-4]",
           "SLURM_JOB_ID": "42"}
    assert resolve_cluster(rank=2, world_size=4, coordinator="h:1", environ=env).local_rank is None
    assert resolve_cluster(rank=2, world_size=4, local_rank=0, coordinator="h:1", environ=env).local_rank == 0
    assert resolve_cluster(environ=env).local_rank == 1


def test_local_rank_unknown_is_left_to_the_rendezvous():
    s = resolve_cluster(environ={"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"})
    assert s.local_rank is None


@pytest.mark.parametrize("env,match", [
    ({"TFCS_RANK": "x", "TFCS_WORLD_SIZE": "2"}, "not an integer"),
    ({"TFCS_RANK": "2", "TFCS_WORLD_SIZE": "2", "TFCS_COORDINATOR": "h:1"}, "outside"),
    ({"TFCS_RANK": "0", "TFCS_WORLD_SIZE": "2", "TFCS_COORDINATOR": "nohostport"}, "not host:port"),
])
def test_bad_values_name_the_problem(env, match):
    with pytest.raises(ConfigurationError, match=match):
        resolve_cluster(environ=env)


def test_split_host_port_ipv6():
    assert split_host_port("[::1]:80") == ("::1", 80)


def test_slurm_steps_of_one_allocation_meet_on_their_own_first_node_and_port():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_ID": "500"}
    a = resolve_cluster(environ=dict(base, SLURM_STEP_ID="0", SLURM_STEP_NODELIST="n[1-2]"))
    b = resolve_cluster(environ=dict(base, SLURM_STEP_ID="1", SLURM_STEP_NODELIST="n[3-4]"))
    c = resolve_cluster(environ=dict(base, SLURM_STEP_ID="2", SLURM_STEP_NODELIST="n[1-2]"))
    assert (a.coordinator, b.coordinator, c.coordinator) == ("n1:29900", "n3:29901", "n1:29902")
    batch = resolve_cluster(environ=dict(base, SLURM_STEP_ID="batch"))  # the batch script itself
    assert batch.coordinator == "n1:29900"
    # the next job's steps on the same nodes: job 501 step 0 must not meet job 500 step 1
    nxt = resolve_cluster(environ=dict(base, SLURM_JOB_ID="501", SLURM_STEP_ID="0", SLURM_STEP_NODELIST="n[3-4]"))
    assert nxt.coordinator != b.coordinator and nxt.coordinator == "n3:29937"  # 29400 + 537


def test_join_host_port_brackets_ipv6_and_round_trips():
    for host in ("10.0.0.1", "node7", "::1", "fe80::1"):
        assert split_host_port(join_host_port(host, 29400)) == (host, 29400)
    assert join_host_port("::1", 80) == "[::1]:80" and join_host_port("h", 80) == "h:80"


def test_default_bind_and_advertise_hosts_follow_the_coordinators_family():
    from tf_commstrategy.rendezvous.rendezvous import default_advertise_host, default_bind_host
    assert (default_bind_host("127.0.0.1"), default_bind_host("::1")) == ("127.0.0.1", "::1")
    assert (default_bind_host("10.0.0.1"), default_bind_host("fd00::5")) == ("0.0.0.0", "::")
    assert (default_advertise_host("localhost"), default_advertise_host("::1")) == ("127.0.0.1", "::1")


def test_tf_config_task_index_beyond_its_type_is_refused():
    cfg = {"cluster": {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, "task": {"type": "chief", "index": 1}}
    with pytest.raises(ConfigurationError, match="chief:1 is not in the cluster spec"):
        resolve_cluster(environ={"TF_CONFIG": json.dumps(cfg)})
    cfg["task"] = {"type": "worker", "index": -1}
    with pytest.raises(ConfigurationError, match="worker:-1"):
        resolve_cluster(environ={"TF_CONFIG": json.dumps(cfg)})


def test_tf_config_master_is_the_chief():
    cfg = {"cluster": {"master": ["m:2222"], "worker": ["w0:2222"]}, "task": {"type": "master", "index": 0}}
    s = resolve_cluster(environ={"TF_CONFIG": json.dumps(cfg)})
    assert (s.rank, s.world_size, s.coordinator) == (0, 2, "m:2222")
    cfg["task"] = {"type": "worker", "index": 0}
    assert resolve_cluster(environ={"TF_CONFIG": json.dumps(cfg)}).rank == 1


# horovodrun's Gloo mode: the variables gloo_run.create_slot_env_vars sets, and its own rendezvous server
_HOROVODRUN = {"HOROVOD_HOSTNAME": "n2", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
               "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
               "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.9", "HOROVOD_GLOO_RENDEZVOUS_PORT": "34567",
               "HOROVOD_CONTROLLER": "gloo"}


def test_horovodrun_variables_with_tfcs_coordinator_or_master_addr():
    s = resolve_cluster(environ=dict(_HOROVODRUN, TFCS_COORDINATOR="n1:5000"))
    assert (s.rank, s.world_size, s.local_rank, s.coordinator, s.source) == (3, 4, 1, "n1:5000",
                                                                            "Horovod (horovodrun)")
    s = resolve_cluster(environ=dict(_HOROVODRUN, MASTER_ADDR="n1", MASTER_PORT="29500"))
    assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (3, 4, 1, "n1:29500")


def test_horovodrun_rendezvous_server_is_not_taken_for_the_coordinator():
    # HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT is horovodrun's own server on the launching host: a job without
    # TFCS_COORDINATOR or MASTER_ADDR/PORT is told to name one
    with pytest.raises(ConfigurationError, match="TFCS_COORDINATOR") as e:
        resolve_cluster(environ=_HOROVODRUN)
    assert "Horovod" in str(e.value) and "34567" not in str(e.value)


def test_horovod_variables_come_before_mpi_and_slurm():
    env = dict(_HOROVODRUN, **_SLURM_STEP, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="4",
               OMPI_COMM_WORLD_LOCAL_RANK="0", MASTER_ADDR="n1", MASTER_PORT="5000")
    s = resolve_cluster(environ=env)
    assert (s.rank, s.local_rank, s.source) == (3, 1, "Horovod (horovodrun)")
    # without a local rank the rendezvous counts it; a single process needs no coordinator
    s = resolve_cluster(environ={"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"})
    assert (s.rank, s.world_size, s.local_rank) == (1, 2, None)
    s = resolve_cluster(environ={"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"})
    assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (0, 1, 0, None)
    assert resolve_cluster(environ={"HOROVOD_RANK": "1"}).source.startswith("default")  # both or none


@pytest.mark.parametrize("bad,match", [({"HOROVOD_LOCAL_RANK": "2"}, "HOROVOD_LOCAL_RANK='2' is outside"),
                                       ({"HOROVOD_CROSS_RANK": "5"}, "HOROVOD_CROSS_RANK='5' is outside"),
                                       ({"HOROVOD_RANK": "three"}, "HOROVOD_RANK='three' is not an integer"),
                                       ({"HOROVOD_RANK": "4"}, "rank 4 is outside")])
def test_horovod_variables_that_disagree_are_refused(bad, match):
    with pytest.raises(ConfigurationError, match=match):
        resolve_cluster(environ=dict(_HOROVODRUN, TFCS_COORDINATOR="n1:5000", **bad))
