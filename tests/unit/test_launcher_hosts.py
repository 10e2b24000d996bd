"""tfcs-run's hosts: -H and --hostfile as horovodrun and mpirun read them, rank placement, which hosts are
this machine, -x, and what a remote worker's environment leaves out."""

import argparse
import shlex
import socket

import pytest

from tf_commstrategy.errors import ConfigurationError
from tf_commstrategy.launcher import hosts as H
from tf_commstrategy.launcher import options as O
from tf_commstrategy.launcher import remote as RM
from tf_commstrategy.launcher import run as R
from tf_commstrategy.launcher import shims


def test_hosts_flag_forms():
    assert H.parse_hosts("a:2,b:2") == [H.Host("a", 2), H.Host("b", 2)]
    assert H.parse_hosts("a,b:3") == [H.Host("a", 1), H.Host("b", 3)]  # mpirun: a bare host is one slot
    assert H.parse_hosts("[fe80::1]:4,10.0.0.2:1") == [H.Host("fe80::1", 4), H.Host("10.0.0.2", 1)]
    assert H.parse_hosts("fe80::2") == [H.Host("fe80::2", 1)]
    for bad, words in (("a:0", "slots"), ("a:x", "slots"), (":2", "no host name"), ("a:1,a:2", "named twice"),
                       ("", "no hosts")):
        with pytest.raises(ConfigurationError, match=words):
            H.parse_hosts(bad)


def test_hostfile_forms_and_errors():
    text = "# cluster\nnode1 slots=4\nnode2:2   # two GPUs\n\nnode3\nnode4 slots=2 max_slots=8\n"
    assert H.parse_hostfile(text) == [H.Host("node1", 4), H.Host("node2", 2), H.Host("node3", 1),
                                      H.Host("node4", 2)]
    with pytest.raises(ConfigurationError, match=r"hosts.txt, line 2: 'node2 gpus=4'"):
        H.parse_hostfile("node1 slots=1\nnode2 gpus=4\n", "hosts.txt")
    with pytest.raises(ConfigurationError, match="line 1"):
        H.parse_hostfile("node1:2 slots=2\n")
    with pytest.raises(ConfigurationError, match="slots must be"):
        H.parse_hostfile("node1 slots=0\n")


def test_placement_fills_hosts_in_order():
    hosts = [H.Host("a", 2), H.Host("b", 3)]
    got = [(s.rank, s.host, s.local_rank, s.local_size) for s in H.place(hosts, 4)]
    assert got == [(0, "a", 0, 2), (1, "a", 1, 2), (2, "b", 0, 2), (3, "b", 1, 2)]
    assert [s.host for s in H.place(hosts, 1)] == ["a"]
    with pytest.raises(ConfigurationError, match=r"-np 6 needs 6 slots but the hosts have 5 \(a:2, b:3\)"):
        H.place(hosts, 6)


def _bindable(addr):
    with socket.socket() as s:
        try:
            s.bind((addr, 0))
            return True
        except OSError:
            return False


def test_which_hosts_are_this_machine():
    assert H.is_local("localhost") and H.is_local("127.0.0.1") and H.is_local(socket.gethostname())
    # documentation ranges (TEST-NET-1..3): none is routed, but a test machine may carry one of them
    candidates = [f"{net}.{i}" for net in ("198.51.100", "203.0.113", "192.0.2") for i in (7, 77)]
    foreign = [a for a in candidates if not _bindable(a)]
    ours = [a for a in candidates if _bindable(a)]
    assert foreign and not any(H.is_local(a) for a in foreign)
    assert all(H.is_local(a) for a in ours)
    assert not H.is_local("no-such-host.invalid")


def _args(*argv):
    return O.build_parser().parse_args([*argv, "true"])


def test_plan_of_local_and_remote_jobs(monkeypatch):
    me = socket.gethostname()
    monkeypatch.setattr(H, "is_local", lambda h: h in (me, "localhost", "127.0.0.1"))
    plan = R.make_plan(_args("-np", "2"))
    assert not plan.multi_host and plan.coordinator_host == "127.0.0.1" and plan.label(1) == "rank 1"
    plan = R.make_plan(_args("-np", "3", "-H", f"{me}:2,192.0.2.1:2"))
    assert plan.remote == {me: False, "192.0.2.1": True} and plan.label(2) == "rank 2 on 192.0.2.1"
    assert plan.coordinator_host == me
    # rank 0 on a loopback name while another host must reach it: refused, with the fix
    for first in ("localhost", "127.0.0.1"):
        with pytest.raises(ConfigurationError, match="loopback name"):
            R.make_plan(_args("-np", "3", "-H", f"{first}:2,192.0.2.1:2"))
    plan = R.make_plan(_args("-np", "2", "-H", "192.0.2.1:1,192.0.2.2:1"))
    assert plan.coordinator_host == "192.0.2.1" and all(plan.remote.values())
    with pytest.raises(ConfigurationError, match="--host applies"):
        R.make_plan(_args("-np", "2", "--host", "127.0.0.1", "-H", "a:2"))


def test_cli_reports_bad_hosts_with_code_2(capsys, tmp_path):
    assert R.run(["-np", "5", "-H", "localhost:2", "true"]) == 2
    assert "-np 5 needs 5 slots" in capsys.readouterr().err
    assert R.run(["-np", "1", "--hostfile", str(tmp_path / "missing"), "true"]) == 2
    assert "cannot be read" in capsys.readouterr().err
    assert R.run(["-np", "1", "-x", "TFCS_SURELY_UNSET_VAR", "true"]) == 2
    assert "TFCS_SURELY_UNSET_VAR is not set here" in capsys.readouterr().err


def test_exports_and_worker_env_order():
    args = _args("-np", "2", "-x", "A=1", "-x", "B", "-x", "TFCS_RANK=99", "--start-timeout", "45")
    base = {"B": "from-here", "A": "old"}
    assert O.exports(args, base) == {"A": "1", "B": "from-here", "TFCS_RANK": "99"}
    env = R.worker_env(base, H.Slot(1, "h", 0, 1), 2, "h:1234", args)
    # the job's own variables win over -x
    assert (env["A"], env["B"], env["TFCS_RANK"], env["TFCS_LOCAL_RANK"]) == ("1", "from-here", "1", "0")
    assert env["TFCS_RENDEZVOUS_TIMEOUT"] == "45.0" and env["TFCS_COORDINATOR"] == "h:1234"


def test_remote_env_and_ssh_command():
    env = {"PATH": "/x", "OLDPWD": "/a", "PWD": "/b", "SSH_AUTH_SOCK": "/s", "BASH_FUNC_f%%": "()", "HOME": "/r",
           "TFCS_TOKEN": "t"}
    assert RM.forwarded_env(env) == {"PATH": "/x", "HOME": "/r", "TFCS_TOKEN": "t"}
    argv = RM.ssh_argv("node2", "ssh -F my.conf", port=2222, identity_file="/k", python="/venv/bin/python")
    assert argv[:3] == ["ssh", "-F", "my.conf"] and "BatchMode=yes" in argv
    assert argv[argv.index("-p") + 1] == "2222" and argv[argv.index("-i") + 1] == "/k"
    assert argv[-2] == "node2"
    remote = shlex.split(argv[-1])
    assert remote[:4] == ["/venv/bin/python", "-S", "-E", "-c"] and remote[4] == shims.REMOTE
    assert "TFCS_TOKEN" not in argv[-1], "the token travels on standard input, never on a command line"
    assert isinstance(O.build_parser(), argparse.ArgumentParser)
