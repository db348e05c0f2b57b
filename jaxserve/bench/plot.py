"""PNG plots of `bench serve` results; several result files (one per server) share the same axes.

- `throughput.png`: output tok/s against the swept variable (concurrency or request rate).
- `latency.png`: TTFT and ITL medians (solid) and p99 (dashed) against it.
- `cdf.png`: TTFT and ITL distributions of each result's heaviest level.
"""

from __future__ import annotations

import math
from pathlib import Path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'jaxserve[bench]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def _x(levels: list[dict]) -> tuple[str, list[float]]:
    """Plot against whichever knob the sweep turned."""
    concurrencies = [level["max_concurrency"] for level in levels]
    if len(set(concurrencies)) > 1 or all(level["request_rate"] == "inf" for level in levels):
        return "max concurrency", [c or math.nan for c in concurrencies]
    return "request rate (req/s)", [float(level["request_rate"]) for level in levels]


def plot(results: dict[str, list[dict]], out_dir: str | Path) -> list[Path]:
    """`results`: {label: that run's levels}. Returns the files written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, levels in results.items():
        name, xs = _x(levels)
        ax.plot(xs, [level["metrics"]["output_throughput"] for level in levels], marker="o", label=label)
    ax.set(xlabel=name, ylabel="output tokens/s", title="Output throughput")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out / "throughput.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "ttft_ms", "Time to first token"), (axes[1], "itl_ms", "Inter-token latency")):
        for i, (label, levels) in enumerate(results.items()):
            name, xs = _x(levels)
            colour = f"C{i}"
            ax.plot(xs, [level["metrics"][metric]["median"] for level in levels], marker="o", color=colour,
                    label=f"{label} p50")
            if "p99" in levels[0]["metrics"][metric]:
                ax.plot(xs, [level["metrics"][metric]["p99"] for level in levels], linestyle="--", color=colour,
                        label=f"{label} p99")
        ax.set(xlabel=name, ylabel="ms", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    written.append(_save(fig, out / "latency.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "ttfts_ms", "TTFT"), (axes[1], "itls_ms", "ITL")):
        for label, levels in results.items():
            values = sorted(levels[-1]["metrics"][key])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))],
                        label=f"{label} ({_x(levels)[0]} {_x(levels)[1][-1]:g})")
        ax.set(xlabel="ms", ylabel="fraction of requests" if key == "ttfts_ms" else "fraction of gaps",
               title=f"{title} distribution (heaviest level)")
        ax.grid(alpha=0.3)
        ax.legend()
    written.append(_save(fig, out / "cdf.png"))
    return written


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path
