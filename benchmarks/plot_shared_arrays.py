"""Plot tfcs / gloo all-reduce time ratios, private numpy arrays against tfcs.shared_empty arrays, from
interleaved tfcs-bench runs (``--compare gloo --interleave --json``, with and without ``--buffers shared``).

    python benchmarks/plot_shared_arrays.py OUT.png [--title=TEXT] LABEL=RUN.json [LABEL=RUN.json ...]

Each run is drawn as its per-size median ratio with the range of its per-round ratios.
"""

import json
import statistics
import sys


def main(argv):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = argv[0]
    title = "shared memory, one host: private arrays vs tfcs.shared_empty"
    runs = []
    for a in argv[1:]:
        if a.startswith("--title="):
            title = a.split("=", 1)[1]
        else:
            runs.append(a.rsplit("=", 1))  # the label may hold "=", a path does not
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, path in runs:
        with open(path) as f:
            d = json.load(f)
        sizes = d["sizes"]
        rr = [d["results"]["gloo"][str(s)]["round_ratios"] for s in sizes]
        med = [statistics.median(r) for r in rr]
        line, = ax.semilogx(sizes, med, marker="o", label=f"{label} ({d['np']} ranks)")
        ax.errorbar(sizes, med, fmt="none", ecolor=line.get_color(), capsize=3,
                    yerr=[[m - min(r) for m, r in zip(med, rr)], [max(r) - m for m, r in zip(med, rr)]])
    ax.axhline(0.3, color="grey", lw=0.8, ls="--", label="target, 2 ranks (0.3)")
    ax.axhline(0.5, color="grey", lw=0.8, ls=":", label="target, 4 ranks (0.5)")
    ax.set_xlabel("all-reduce size (bytes, float32)")
    ax.set_ylabel("tfcs time / gloo time (lower: tfcs faster)")
    ax.set_title(title)
    ax.set_ylim(0, 0.6)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
