"""All-reduce across hosts joined by a shaped link, side by side with gloo, in the same processes.

    sudo python benchmarks/link_allreduce.py [--rate 1gbit] [--configs default,tcp,fp16] [--json out.json]

Two network-namespace hosts on one bridge (tests/netns/hosts.py), every link shaped with ``tc tbf`` to
``--rate`` both ways (this kernel has no netem: no delay), one rank per host. For each configuration a
fresh job runs ``tf_commstrategy.bench.workers`` in both namespaces: tfcs and gloo (torch) take turns
in rounds, size by size, in the same processes, so each round's ratio compares calls made moments apart
on the same link (``tfcs-bench --interleave``). The configurations:

* ``default``: what a job gets between hosts with no settings;
* ``grpc`` / ``tcp``: ``TFCS_TRANSPORT`` set to that data path;
* ``fp16`` / ``bf16``: the default data path with ``TFCS_COMPRESSION`` (docs/usage.md): float32 travels
  as 16-bit values; gloo moves float32 as always;
* ``small-pass``: the default data path with the small all-reduce's one all-gather pass up to 64 KiB
  x (ranks - 1) (``TFCS_SMALL_ALLREDUCE_BYTES=64K``; off between hosts by default).

The table reports tfcs's median time, its bus bandwidth as a fraction of the link's rate (nccl-tests'
convention: 2 (n-1)/n of the buffer crosses each link; for a compressed call the float32 buffer's size,
so it can exceed 1), gloo's, and tfcs / gloo (below 1: tfcs is faster). Needs root (``ip netns``,
``tc``); without torch gloo is left out and tfcs runs alone. `make bench-link` writes
bench-results/link_*.json, docs/benchmarks.md holds the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.helpers import free_port  # noqa: E402
from tests.netns import hosts as H  # noqa: E402
from tf_commstrategy.bench import cli  # noqa: E402
from tf_commstrategy.config import parse_size  # noqa: E402

CONFIGS = {
    "default": {},
    "grpc": {"TFCS_TRANSPORT": "grpc"},
    "tcp": {"TFCS_TRANSPORT": "tcp"},
    "fp16": {"TFCS_COMPRESSION": "fp16"},
    "bf16": {"TFCS_COMPRESSION": "bf16"},
    "small-pass": {"TFCS_SMALL_ALLREDUCE_BYTES": "64K"},
}
JOB_TIMEOUT_S = 900


def rate_bytes_per_s(rate: str) -> float:
    """``tc``'s rate ("1gbit", "10gbit", "500mbit") in bytes per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    for suffix, mult in units.items():
        if rate.endswith(suffix):
            return float(rate[:-len(suffix)]) * mult / 8
    raise SystemExit(f"link_allreduce: cannot read the rate {rate!r} (use e.g. 1gbit, 500mbit)")


def run_config(hosts, name: str, sizes, args, tmp: str, impls) -> dict:
    """One job of one rank per host running ``impls`` in turn; {impl: raw results} (see tfcs-bench)."""
    out = os.path.join(tmp, f"{name}.json")
    port, bench_ports = free_port(), [free_port() for _ in range(hosts.n + 1)]
    procs = []
    for rank in range(hosts.n):
        env = dict(os.environ, TFCS_RANK=str(rank), TFCS_WORLD_SIZE=str(hosts.n), TFCS_LOCAL_RANK="0",
                   TFCS_COORDINATOR=f"{hosts.addresses[0]}:{port}", TFCS_BENCH_PORTS=",".join(map(str, bench_ports)),
                   TFCS_BENCH_HOSTS=",".join(hosts.addresses), GLOO_SOCKET_IFNAME="eth0",
                   PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", **CONFIGS[name])
        for k in ("TFCS_TRANSPORT", "TFCS_COMPRESSION", "TFCS_SMALL_ALLREDUCE_BYTES"):
            if k not in CONFIGS[name]:
                env.pop(k, None)
        cmd = [sys.executable, "-m", "tf_commstrategy.bench.workers", "--impl", ",".join(impls), "--op", "allreduce",
               "--sizes", ",".join(map(str, sizes)), "--budget", str(args.budget), "--rounds", str(args.rounds),
               "--out", out]
        procs.append(hosts.popen(rank, cmd, env=env))
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=JOB_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    if any(codes):
        print(f"link_allreduce: {name}: exit codes {codes}; left out", file=sys.stderr)
        return {}
    raw = {}
    for impl in impls:
        path = f"{out}.{impl}" if len(impls) > 1 else out
        with open(path) as f:
            r = json.load(f)
        r["times"] = cli.slowest_rank(r["times"], [f"{path}.rank{q}" for q in range(hosts.n)])
        raw[impl] = r
    return raw


def _cells(nbytes: int, r: dict):
    rr = r["round_ratios"]
    yield cli.human(nbytes)
    yield cli.fmt_time(r["tfcs_s"])
    yield f"{r['tfcs_busbw_of_link']:.2f}"
    if r["gloo_s"] is None:
        yield from ("-", "-", "-", "-")
        return
    yield cli.fmt_time(r["gloo_s"])
    yield f"{r['gloo_busbw_of_link']:.2f}"
    yield f"{r['ratio']:.2f}"
    yield f"{min(rr):.2f}-{max(rr):.2f}" if rr else "-"


def report(name: str, raw: dict, sizes, n: int, link: float) -> dict:
    results = {impl: cli.summarize(r, "allreduce", n) for impl, r in raw.items()}
    cli.add_round_ratios(results, raw)
    rows = {}
    for s in sizes:
        me, gloo = results["tfcs"].get(s), results.get("gloo", {}).get(s, {})
        if not me:
            continue
        rows[s] = {"tfcs_s": me["median_s"], "tfcs_busbw_of_link": me["busbw_GBps"] * 1e9 / link,
                   "gloo_s": gloo.get("median_s"),
                   "gloo_busbw_of_link": gloo["busbw_GBps"] * 1e9 / link if gloo else None,
                   "ratio": cli.ratio_of(results, "gloo", s), "round_ratios": gloo.get("round_ratios")}
    info = raw["tfcs"].get("info", {})
    print(f"\n{name}: transport {info.get('transport', '?')}")
    print("| size | tfcs time | tfcs busbw / link | gloo time | gloo busbw / link | tfcs / gloo | per round |")
    print("|---|---|---|---|---|---|---|")
    for s, r in rows.items():
        print("| " + " | ".join(_cells(s, r)) + " |", flush=True)
    return {"transport": info.get("transport"), "rows": {str(k): v for k, v in rows.items()}}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="1gbit", help="tc tbf rate of every link")
    p.add_argument("--burst", default=None, help="tc tbf burst (default: 256kb, 4mb from 10gbit)")
    p.add_argument("--configs", default="default,tcp,fp16", help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--sizes", default="8,4K,256K,4M,64M")
    p.add_argument("--budget", type=float, default=3.0, help="approximate seconds per size and implementation")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    names = [c for c in a.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configurations {unknown} (use {sorted(CONFIGS)})")
    reason = H.unavailable_reason()
    if reason:
        sys.exit(f"link_allreduce: {reason}")
    try:
        import torch  # noqa: F401
        impls = ("tfcs", "gloo")
    except ImportError:
        print("link_allreduce: torch is not importable, gloo left out (pip install torch==2.13.0)", file=sys.stderr)
        impls = ("tfcs",)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    link = rate_bytes_per_s(a.rate)
    burst = a.burst or ("4mb" if link >= 1e9 else "256kb")
    out = {"rate": a.rate, "burst": burst, "sizes": sizes, "rounds": a.rounds, "impls": impls, "configs": {}}
    with H.NetnsHosts(2) as hosts, tempfile.TemporaryDirectory() as tmp:
        hosts.shape(a.rate, burst=burst)
        for name in names:
            raw = run_config(hosts, name, sizes, a, tmp, impls)
            if raw:
                out["configs"][name] = report(name, raw, sizes, hosts.n, link)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if len(out["configs"]) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
