"""``tfcs-bench``: collective latency and bandwidth, side by side with the peers, in one run.

    tfcs-bench -np 2 --op allreduce --sizes 8,4K,256K,4M,64M,256M --compare tf-ring,gloo \\
               --json results.json --plot allreduce.png

For each size: the median time of many calls after warm-up, the algorithm bandwidth
(bytes / time) and the bus bandwidth (nccl-tests convention: allreduce busbw = algbw * 2(n-1)/n,
allgather (n-1)/n, broadcast 1). Each peer runs as its own job of N fresh processes in the same
invocation, on the same sizes; the table reports tfcs's time divided by the peer's (below 1: tfcs
is faster).

The calls run back to back by default: the buffers stay in the caches and every rank is already
waiting when its peers send. ``--gap-ms G`` keeps every rank busy for G ms before each call (only
the call is timed), as a training step computes between its all-reduces: the buffers have left the
caches by then, which is what a collective costs inside ``model.fit``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
from typing import Dict, List, Optional

from ..config import parse_size
from ..launcher import run as launcher


def _free_ports(n: int) -> List[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def bus_factor(op: str, n: int) -> float:
    if n == 1:
        return 1.0
    return {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reduce_scatter": (n - 1) / n}.get(op, 1.0)


def human(nbytes: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def fmt_time(t: float) -> str:
    if t < 1e-3:
        return f"{t * 1e6:.0f} us"
    if t < 1:
        return f"{t * 1e3:.2f} ms"
    return f"{t:.2f} s"


_STOPPED_BY = {128 + int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


class Interrupted(Exception):
    """A signal ended a job of the benchmark (tfcs-run's exit code 128 + signal)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def run_job(impls: List[str], args, sizes: List[int]) -> Dict[str, Dict]:
    """One job of ``args.np`` fresh processes that runs ``impls``: one implementation, or several taking
    turns in ``args.rounds`` rounds (``--interleave``). Returns {impl: its results}, {} where it failed.

    Raises:
      Interrupted: a signal ended the job.
    """
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        # N ports for tf-ring's servers and one more for gloo's rendezvous (both may share a job)
        os.environ["TFCS_BENCH_PORTS"] = ",".join(map(str, _free_ports(args.np + 1)))
        if args.transport:
            os.environ["TFCS_TRANSPORT"] = args.transport
        cmd = [sys.executable, "-m", "tf_commstrategy.bench.workers", "--impl", ",".join(impls), "--op", args.op,
               "--sizes", ",".join(map(str, sizes)), "--budget", str(args.budget), "--gap-ms", str(args.gap_ms),
               "--rounds", str(args.rounds), "--out", out]
        if "tfcs" in impls and args.backend:
            cmd += ["--backend", args.backend]
        if "tfcs" in impls and args.buffers != "private":
            cmd += ["--buffers", args.buffers]
        print(f"tfcs-bench: running {' and '.join(impls)} ({args.np} workers"
              f"{f', {args.rounds} rounds in turn' if len(impls) > 1 else ''})...", file=sys.stderr, flush=True)
        code = launcher.run(["-np", str(args.np), "--no-prefix"] + cmd)
        if code in _STOPPED_BY:  # Ctrl-C (or SIGTERM / SIGHUP) ended the run: no further jobs
            raise Interrupted(code)
        got = {}
        for impl in impls:
            path = out if len(impls) == 1 else f"{out}.{impl}"
            if code != 0 or not os.path.exists(path):
                print(f"tfcs-bench: {impl} failed (exit code {code}); left out of the table", file=sys.stderr)
                got[impl] = {}
                continue
            with open(path) as f:
                raw = json.load(f)
            raw["times"] = slowest_rank(raw["times"], [f"{path}.rank{r}" for r in range(args.np)])
            got[impl] = raw
        return got


def round_ratios(mine: List[float], theirs: List[float], per_round: int) -> List[float]:
    """Per round of an interleaved run: the median of tfcs's calls over the median of the peer's.

    Args:
      mine, theirs: per-call times, round after round, ``per_round`` calls each.

    Returns:
      One ratio per round both have in full.
    """
    rounds = min(len(mine), len(theirs)) // per_round
    return [statistics.median(mine[r * per_round:(r + 1) * per_round]) /
            statistics.median(theirs[r * per_round:(r + 1) * per_round]) for r in range(rounds)]


def slowest_rank(times: Dict[str, List[float]], rank_files: List[str]) -> Dict[str, List[float]]:
    """Each call's time on its slowest rank (the call is over when every rank has its result).

    Args:
      times: rank 0's per-call times by size.
      rank_files: every rank's times, one JSON file each (missing files are skipped).

    Returns:
      Per size, the largest time of each call over the ranks.
    """
    out = {k: list(v) for k, v in times.items()}
    for path in rank_files:
        try:
            with open(path) as f:
                theirs = json.load(f)
        except (OSError, ValueError):
            continue
        for k, ts in theirs.items():
            if k in out and len(ts) == len(out[k]):
                out[k] = [max(a, b) for a, b in zip(out[k], ts)]
    return out


def summarize(raw: Dict, op: str, n: int) -> Dict[int, Dict[str, float]]:
    rows = {}
    for k, times in raw.get("times", {}).items():
        nbytes = int(k)
        med = statistics.median(times)
        algbw = nbytes / med / 1e9
        rows[nbytes] = {"median_s": med, "algbw_GBps": algbw, "busbw_GBps": algbw * bus_factor(op, n),
                        "iters": len(times)}
    return rows


def add_round_ratios(results: Dict[str, Dict[int, Dict]], raw: Dict[str, Dict]) -> None:
    """For an interleaved run: each peer's row gets ``round_ratios`` (tfcs / peer, one per round) and
    ``ratio``, their median: the figure the table reports, as each round compares calls made moments
    apart on the same machine state."""
    mine = raw.get("tfcs", {})
    if not mine.get("interleaved"):
        return
    rounds = mine["interleaved"]["rounds"]
    for peer, rows in results.items():
        if peer == "tfcs":
            continue
        for nbytes, row in rows.items():
            k = str(nbytes)
            if k in mine["times"] and k in raw[peer]["times"]:  # each round of a size holds as many calls
                ratios = round_ratios(mine["times"][k], raw[peer]["times"][k], len(mine["times"][k]) // rounds)
                if ratios:
                    row["round_ratios"] = ratios
                    row["ratio"] = statistics.median(ratios)


def ratio_of(results: Dict[str, Dict[int, Dict]], peer: str, nbytes: int) -> Optional[float]:
    """tfcs's time over ``peer``'s at one size, as the table and the plot report it: the median of the
    per-round ratios in an interleaved run, else the ratio of the two medians (None: a side is missing)."""
    me, other = results.get("tfcs", {}).get(nbytes), results.get(peer, {}).get(nbytes)
    if other is not None and "ratio" in other:
        return other["ratio"]
    return me["median_s"] / other["median_s"] if me and other else None


def table(results: Dict[str, Dict[int, Dict]], sizes: List[int], op: str, n: int) -> str:
    """Markdown: tfcs's median time and bandwidth per size, each peer's median and the ratio. In an
    interleaved run the ratio is the median of the per-round ratios, their range beside it."""
    impls = list(results)
    peers = [i for i in impls if i != "tfcs"]
    rounds = any("ratio" in row for p in peers for row in results[p].values())
    head = ["size", "tfcs time", "algbw GB/s", "busbw GB/s"]
    for p in peers:
        head += [f"{p} time", f"tfcs/{p}"] + ([f"tfcs/{p} per round"] if rounds else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sizes:
        me = results.get("tfcs", {}).get(s)
        row = [human(s)]
        row += [fmt_time(me["median_s"]), f"{me['algbw_GBps']:.3f}", f"{me['busbw_GBps']:.3f}"] if me else \
            ["-", "-", "-"]
        for p in peers:
            other = results[p].get(s)
            row.append(fmt_time(other["median_s"]) if other else "-")
            ratio = ratio_of(results, p, s)
            row.append(f"{ratio:.2f}" if ratio is not None else "-")
            if rounds:
                rr = (other or {}).get("round_ratios")
                row.append(f"{min(rr):.2f}-{max(rr):.2f}" if rr else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results, sizes, op, n, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for impl, rows in results.items():
        xs = [s for s in sizes if s in rows]
        ax1.loglog(xs, [rows[s]["median_s"] * 1e3 for s in xs], marker="o", label=impl)
        if impl != "tfcs" and "tfcs" in results:
            both = [s for s in xs if s in results["tfcs"]]
            ratios = [ratio_of(results, impl, s) for s in both]
            line, = ax2.semilogx(both, ratios, marker="o", label=f"tfcs / {impl}")
            spans = [rows[s].get("round_ratios") for s in both]
            if any(spans):  # an interleaved run: each size's per-round range around the median
                ax2.errorbar(both, ratios, fmt="none", ecolor=line.get_color(), capsize=3,
                             yerr=[[r - min(rr) if rr else 0 for r, rr in zip(ratios, spans)],
                                   [max(rr) - r if rr else 0 for r, rr in zip(ratios, spans)]])
    ax1.set_xlabel("message size (bytes)")
    ax1.set_ylabel("median time (ms)")
    ax1.set_title(f"{op}, {n} ranks, float32")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend()
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_xlabel("message size (bytes)")
    ax2.set_ylabel("time ratio (lower: tfcs faster)")
    ax2.set_title("tfcs time / peer time")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)


def cma_text(info: dict) -> str:
    """", cross-memory reads from 4 MiB" when some of tfcs's all-reduces read the peers' private arrays."""
    if not info.get("cma_allreduces"):
        return ""
    return f", cross-memory reads from {human(info['cross_memory_bytes'])}"


def _parser() -> argparse.ArgumentParser:
    """The command line of ``tfcs-bench``."""
    p = argparse.ArgumentParser(prog="tfcs-bench", description=__doc__.split("\n")[0])
    p.add_argument("-np", type=int, default=2)
    p.add_argument("--op", choices=["allreduce", "broadcast", "allgather"], default="allreduce")
    p.add_argument("--sizes", default="8,4K,256K,4M,64M,256M")
    p.add_argument("--backend", choices=["grpc", "nccl", "auto"], default="grpc")
    p.add_argument("--transport", choices=["auto", "shm", "unix", "tcp", "grpc"], default=None,
                   help="data path under the ring (TFCS_TRANSPORT; default auto: shared memory on one host)")
    p.add_argument("--buffers", choices=["private", "shared"], default="private",
                   help="tfcs's all-reduce arrays: private numpy arrays (default), or arrays from "
                        "tfcs.shared_empty (one host: the all-reduce reads the peers' arrays in place)")
    p.add_argument("--compare", default="", help="comma-separated peers: tf-ring, gloo")
    p.add_argument("--budget", type=float, default=1.5, help="approximate seconds spent per size and impl")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="keep every rank busy this long before each timed call, as a training step's compute "
                        "does (default 0: back-to-back calls)")
    p.add_argument("--interleave", action="store_true",
                   help="run tfcs and the peers in the same processes, taking turns size by size in --rounds "
                        "rounds; the ratio is the median of the per-round ratios (machine-state drift cancels)")
    p.add_argument("--rounds", type=int, default=6,
                   help="rounds of an --interleave run (default 6; at least 3 calls per round and implementation, "
                        "so the largest sizes may take longer than --budget)")
    p.add_argument("--json", help="write all results here")
    p.add_argument("--plot", help="write a PNG plot here")
    return p


def _select_peers(p: argparse.ArgumentParser, args) -> List[str]:
    """The peers of ``--compare`` that can run this op here; without any, the run is not interleaved.

    An unknown peer is a usage error; gloo without torch and tf-ring for a broadcast are left out with a
    note on stderr.
    """
    peers = [c for c in args.compare.split(",") if c]
    for c in peers:
        if c not in ("tf-ring", "gloo"):
            p.error(f"unknown peer {c!r} (use tf-ring, gloo)")
    if "gloo" in peers:
        try:
            import torch  # noqa: F401
        except ImportError:
            print("tfcs-bench: torch is not importable, gloo left out (pip install torch==2.13.0)", file=sys.stderr)
            peers.remove("gloo")
    if args.op == "broadcast" and "tf-ring" in peers:  # it has no broadcast to compare with
        print("tfcs-bench: tf-ring has no broadcast primitive, left out", file=sys.stderr)
        peers.remove("tf-ring")
    if not peers:
        args.interleave, args.rounds = False, 1
    return peers


def _run_jobs(peers: List[str], args, sizes: List[int]) -> dict:
    """The raw results of every implementation: one shared interleaved job, or one job each.

    A failed interleaved job falls back to one job per implementation (and clears ``args.interleave``).
    """
    raw = run_job(["tfcs"] + peers, args, sizes) if args.interleave else {}
    if args.interleave and not raw["tfcs"]:  # the shared job failed: each on its own, as without it
        print("tfcs-bench: the interleaved job failed; running each implementation as its own job",
              file=sys.stderr)
        args.interleave, args.rounds, raw = False, 1, {}
    if not args.interleave:
        for impl in ["tfcs"] + peers:
            raw.update(run_job([impl], args, sizes))
    return raw


def _report(args, sizes: List[int], results: dict, info: dict) -> None:
    """Print the heading and the table, and write the ``--json`` and ``--plot`` files when asked."""
    print(f"\n{args.op}, {args.np} ranks, float32, backend {args.backend}, transport "
          f"{info.get('transport', '?')}, all-reduce {info.get('allreduce', '?')}, "
          f"{'shared' if info.get('buffers') == 'shared' else 'private'} buffers"
          f"{cma_text(info)}, calls "
          f"{f'{args.gap_ms:g} ms apart (ranks busy in between)' if args.gap_ms else 'back to back'}"
          f"{f', the peers in the same processes, {args.rounds} rounds in turn' if args.interleave else ''}\n")
    print(table(results, sizes, args.op, args.np))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"op": args.op, "np": args.np, "backend": args.backend, "sizes": sizes, "gap_ms": args.gap_ms,
                       "interleaved_rounds": args.rounds if args.interleave else None, "tfcs_info": info,
                       "results": {k: {str(s): v for s, v in r.items()} for k, r in results.items()}}, f, indent=1)
    if args.plot and results:
        plot(results, sizes, args.op, args.np, args.plot)


def main(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    if args.gap_ms < 0:
        p.error(f"--gap-ms must be 0 or more, got {args.gap_ms}")
    if args.rounds < 1:
        p.error(f"--rounds must be 1 or more, got {args.rounds}")
    if not args.interleave:
        args.rounds = 1
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    peers = _select_peers(p, args)
    try:
        raw = _run_jobs(peers, args, sizes)
    except Interrupted as e:
        print(f"tfcs-bench: interrupted (exit code {e.code}); the remaining jobs were not run", file=sys.stderr)
        return e.code
    results = {impl: summarize(r, args.op, args.np) for impl, r in raw.items() if r}
    add_round_ratios(results, raw)
    info = raw.get('tfcs', {}).get('info', {})
    _report(args, sizes, results, info)
    return 0 if "tfcs" in results else 1


if __name__ == "__main__":
    sys.exit(main())
