"""Mutual TLS on every gRPC port of a job, with certificates made here by openssl."""

import os
import shutil
import subprocess

import numpy as np
import pytest

from tests.helpers import free_port, run_workers

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def make_certs(d, name="worker", ca=None):
    """A CA (unless given) and a certificate for 127.0.0.1 / localhost signed by it; returns paths."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    if ca is None:
        run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=tfcs-test-ca")
        ca = (os.path.join(d, "ca.pem"), os.path.join(d, "ca.key"))
    run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", "/CN=127.0.0.1")
    with open(os.path.join(d, f"{name}.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n")
    run("x509", "-req", "-in", f"{name}.csr", "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")
    return {"cert": os.path.join(d, f"{name}.pem"), "key": os.path.join(d, f"{name}.key"), "ca": ca[0],
            "ca_key": ca[1]}


def _tls_job(rank, size):
    import tf_commstrategy as tfcs
    from tf_commstrategy.process import default_group
    tfcs.init()
    out = [tfcs.allreduce(np.arange(1000, dtype=np.float64) * (rank + 1)),
           tfcs.broadcast(np.arange(5) + rank, root_rank=1), tfcs.allgather(np.array([rank]))]
    return out, default_group().backend("grpc").transport, default_group().tls is not None


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_job_over_mutual_tls_gives_numpy_results(tmp_path, transport):
    c = make_certs(str(tmp_path))
    env = {"TFCS_TLS_CERT": c["cert"], "TFCS_TLS_KEY": c["key"], "TFCS_TLS_CA": c["ca"], "TFCS_TRANSPORT": transport}
    res = run_workers(_tls_job, 3, timeout=150, env=env)
    for rank, (out, data_path, tls) in enumerate(res):
        np.testing.assert_array_equal(out[0], np.arange(1000) * 6.0)
        np.testing.assert_array_equal(out[1], np.arange(5) + 1)
        np.testing.assert_array_equal(out[2], [0, 1, 2])
        assert tls and data_path == ("grpc" if transport == "grpc" else "shm")


@pytest.mark.timeout(120)
def test_tls_ports_refuse_plaintext_and_foreign_certificates(tmp_path):
    import grpc
    from tf_commstrategy.core import grpc_util
    from tf_commstrategy.errors import RendezvousError
    from tf_commstrategy.rendezvous.coordinator import CoordinatorClient, CoordinatorServer
    good = make_certs(str(tmp_path))
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    foreign = make_certs(str(other_dir), "intruder")  # signed by another CA
    tls = grpc_util.TlsConfig.from_paths(good["cert"], good["key"], good["ca"])
    port = free_port()
    srv = CoordinatorServer(f"127.0.0.1:{port}", world_size=1, tls=tls)
    try:
        ok = CoordinatorClient(f"127.0.0.1:{port}", 0, tls=tls)
        ok.set("k", "v")
        assert ok.get("k", timeout=5) == "v"
        ok.close()
        plain = CoordinatorClient(f"127.0.0.1:{port}", 0)
        with pytest.raises(RendezvousError):
            plain.get("k", timeout=3)
        plain.close()
        bad_tls = grpc_util.TlsConfig.from_paths(foreign["cert"], foreign["key"], foreign["ca"])
        intruder = CoordinatorClient(f"127.0.0.1:{port}", 0, tls=bad_tls)
        with pytest.raises(RendezvousError):
            intruder.get("k", timeout=3)
        intruder.close()
        # a client that trusts our CA but has no client certificate of ours is refused too
        ch = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(
            root_certificates=open(good["ca"], "rb").read()))
        with pytest.raises(grpc.RpcError):
            grpc_util.unary(ch, "Coordinator", "Get")(b'{"key": "k"}', timeout=3)
        ch.close()
    finally:
        srv.stop()


def test_tls_settings_errors(tmp_path):
    import tf_commstrategy as tfcs
    from tf_commstrategy.core import grpc_util
    with pytest.raises(tfcs.ConfigurationError, match="TFCS_TLS_CERT"):
        grpc_util.TlsConfig.from_env({"TFCS_TLS_CERT": "/x.pem"})
    with pytest.raises(tfcs.ConfigurationError, match="cannot read the TLS certificate"):
        grpc_util.TlsConfig.from_env({"TFCS_TLS_CERT": "/nonexistent.pem", "TFCS_TLS_KEY": "k", "TFCS_TLS_CA": "c"})
    c = make_certs(str(tmp_path))
    for spelling in ("tcp", "TCP", " tcp "):  # any spelling the ring accepts as tcp is refused under TLS
        with pytest.raises(tfcs.ConfigurationError, match="unencrypted"):
            tfcs.init(rank=0, world_size=1, transport=spelling, tls_cert=c["cert"], tls_key=c["key"], tls_ca=c["ca"])
    from tf_commstrategy.process_group import GroupSettings, ProcessGroup
    from tf_commstrategy.rendezvous.cluster_env import ClusterSpec
    spec = ClusterSpec(0, 1, 0, None, "")
    with pytest.raises(tfcs.ConfigurationError, match="unencrypted"):  # TFCS_TRANSPORT too
        ProcessGroup(GroupSettings.resolve(spec, environ={"TFCS_TRANSPORT": "Tcp", "TFCS_TLS_CERT": c["cert"],
                                                          "TFCS_TLS_KEY": c["key"], "TFCS_TLS_CA": c["ca"]}))
    with pytest.raises(tfcs.ConfigurationError, match="unknown transport"):
        GroupSettings.resolve(spec, environ={"TFCS_TRANSPORT": "rdma"})
