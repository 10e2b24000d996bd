"""The launch recipes in examples/launch/: the environment each engine gives resolves as documented."""

import json
import os
import re

import pytest

from tests.helpers import ROOT
from tf_commstrategy.rendezvous.cluster_env import resolve_cluster

LAUNCH = os.path.join(ROOT, "examples", "launch")


def _read(name):
    with open(os.path.join(LAUNCH, name)) as f:
        return f.read()


def _exports(text):
    return dict(re.findall(r"^export (TFCS_[A-Z_]+)=([^\s\"$(]+)\s*$", text, flags=re.M))


def test_slurm_recipe_two_nodes_two_tasks_each():
    text = _read("slurm.sbatch")
    nodes = int(re.search(r"--nodes=(\d+)", text).group(1))
    per_node = int(re.search(r"--ntasks-per-node=(\d+)", text).group(1))
    exported = _exports(text)
    assert "srun" in text and exported["TFCS_COORDINATOR_PORT"] == "29431"
    n = nodes * per_node
    for procid in range(n):  # what srun sets for each task
        env = dict(exported, SLURM_PROCID=str(procid), SLURM_NTASKS=str(n), SLURM_LOCALID=str(procid % per_node),
                   SLURM_JOB_NODELIST="gpu[07-08]", SLURM_JOB_ID="4242")
        s = resolve_cluster(environ=env)
        assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (procid, n, procid % per_node, "gpu07:29431")


def test_mpirun_recipe_passes_the_coordinator():
    text = _read("mpirun.sh")
    np_ = int(re.search(r"NP=\$\{NP:-(\d+)\}", text).group(1))
    assert 'mpirun -np "$NP"' in text
    assert "-x TFCS_COORDINATOR=" in text and "-x TFCS_TOKEN" in text
    hosts = re.search(r"HOSTS=\$\{HOSTS:-([^}]+)\}", text).group(1)
    first = hosts.split(":")[0]
    for r in range(np_):
        env = {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_SIZE": str(np_),
               "OMPI_COMM_WORLD_LOCAL_RANK": str(r % 2), "TFCS_COORDINATOR": f"{first}:29500"}
        s = resolve_cluster(environ=env)
        assert (s.rank, s.world_size, s.local_rank, s.coordinator) == (r, np_, r % 2, "node1:29500")
    assert re.search(r"PORT=\$\{PORT:-29500\}", text) and '"$FIRST_HOST:$PORT"' in text


def test_tfjob_recipe_chief_first_then_workers():
    text = _read("tfjob.yaml")
    chief = int(re.search(r"Chief:\s*\n\s*replicas: (\d+)", text).group(1))
    workers = int(re.search(r"Worker:\s*\n\s*replicas: (\d+)", text).group(1))
    port = int(re.search(r"containerPort: (\d+)", text).group(1))
    assert text.count("secretKeyRef: {name: tfcs-job, key: token}") == 2
    # what the Kubeflow operator puts into TF_CONFIG
    cluster = {"chief": [f"tfcs-mnist-chief-0.default.svc:{port}"],
               "worker": [f"tfcs-mnist-worker-{i}.default.svc:{port}" for i in range(workers)]}
    tasks = [("chief", 0)] + [("worker", i) for i in range(workers)]
    for want_rank, (ttype, idx) in enumerate(tasks):
        env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": ttype, "index": idx}})}
        s = resolve_cluster(environ=env)
        assert (s.rank, s.world_size, s.coordinator) == (want_rank, chief + workers, cluster["chief"][0])


@pytest.mark.parametrize("rank", [0, 3])
def test_any_engine_recipe_variables(rank):
    text = _read("any_engine.sh")
    for var in ("TFCS_RANK", "TFCS_WORLD_SIZE", "TFCS_COORDINATOR"):
        assert var in text
    s = resolve_cluster(environ={"TFCS_RANK": str(rank), "TFCS_WORLD_SIZE": "4", "TFCS_COORDINATOR": "head:7000"})
    assert (s.rank, s.world_size, s.coordinator) == (rank, 4, "head:7000")



def test_a_reaped_workers_group_number_in_use_again_is_not_signalled(monkeypatch):
    # the worker exited and was reaped; its pid now belongs to another process (here: this one), so a
    # group of that number is not the worker's (the kernel reuses no pid that still names a group)
    import os
    import signal
    from tf_commstrategy.launcher import run as R

    class Reaped:
        def __init__(self, pid):
            self.pid, self.returncode = pid, 0

        def poll(self):
            return 0

    sent = []
    monkeypatch.setattr(R.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
    R.Job([Reaped(os.getpid())]).signal_all(signal.SIGTERM, groups=True)
    assert sent == []
    dead = 2 ** 22 + 12345  # above pid_max's default: no process has it
    R.Job([Reaped(dead)]).signal_all(signal.SIGTERM, groups=True)
    assert sent == [(dead, signal.SIGTERM)]  # its own group may still hold what it started


def test_tfjob_image_recipe_holds_the_package_and_the_script_the_pods_run():
    docker = _read("Dockerfile")
    job = _read("tfjob.yaml")
    copied = [src for line in re.findall(r"^COPY (.+)$", docker, flags=re.M) for src in line.split()[:-1]]
    for src in copied:  # every COPY source exists, relative to the repository root (the build context)
        assert os.path.exists(os.path.join(ROOT, src)), src
    # what `pip install .` needs: the build file, the readme it names, the package
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        readme = re.search(r'^readme = "([^"]+)"', f.read(), flags=re.M).group(1)
    assert {"pyproject.toml", readme, "tf_commstrategy"} <= set(copied)
    assert re.search(r"^RUN pip install .*\.\s*$", docker, flags=re.M)
    workdir = re.search(r"^WORKDIR (\S+)", docker, flags=re.M).group(1)
    assert job.count(f"workingDir: {workdir}") == 2
    for command in re.findall(r"command: (\[.*\])", job):
        argv = json.loads(command)
        script = argv[1]
        assert argv[0] == "python" and os.path.isfile(os.path.join(ROOT, script)), argv
        assert any(script == c or script.startswith(c.rstrip("/") + "/") for c in copied), (script, copied)


def test_tfjob_recipe_is_a_tfjob_the_training_operator_accepts():
    # what Kubeflow's training operator (kubeflow.org/v1 TFJob) reads: replica specs keyed by type, each
    # with replicas, a restart policy and a pod template whose container is named "tensorflow" and
    # exposes the port named "tfjob-port" (the one it writes into TF_CONFIG)
    import yaml
    job = yaml.safe_load(_read("tfjob.yaml"))
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    assert job["metadata"]["name"]
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) == {"Chief", "Worker"}
    assert specs["Chief"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    for kind, spec in specs.items():
        assert spec["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode"), kind
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow", kind
        assert container["image"] and container["command"][:2] == ["python", "examples/keras_mnist.py"]
        assert [p["name"] for p in container["ports"]] == ["tfjob-port"]
        token = {e["name"]: e for e in container["env"]}["TFCS_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"] == {"name": "tfcs-job", "key": "token"}
