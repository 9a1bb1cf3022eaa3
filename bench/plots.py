"""Draw the benchmark's plots from its JSON: PNG with matplotlib, else plain SVG.

    python plots.py RESULTS.json OUT_DIR

run.py calls this with the peers venv's interpreter, which has matplotlib; without it
only the burst timelines are drawn, as hand-written SVG. Prints the files it wrote.
"""
import json
import sys
from pathlib import Path

COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f"]


def _lanes(jobs):
    """device -> [(start, end, index, overlapping)] relative to nothing (absolute times)."""
    per = {}
    for job in jobs:
        if job["start"] is None:
            continue
        for device in job["devices"]:
            per.setdefault(device, []).append([job["start"], job["end"] or job["start"], job["i"], False])
    for spans in per.values():
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            if b[0] < a[1]:
                a[3] = b[3] = True
    return per


def _title(tool, run):
    return (f"{tool}: {run['ok']} ran, {run['failures']} failed, {run['overlap_pairs']} overlapping pairs, "
            + (f"makespan {run['makespan_s']} s" if run.get("makespan_s") is not None else "no job ran"))


def timelines_mpl(plt, results, out_dir):
    written = []
    for topology, data in results.get("burst", {}).items():
        tools = data["tools"]
        fig, axes = plt.subplots(len(tools), 1, figsize=(11, 2.2 * len(tools) + 0.6), squeeze=False, sharex=True)
        for ax, (tool, run) in zip(axes[:, 0], tools.items()):
            lanes = _lanes(run["jobs"])
            names = sorted(lanes)
            for y, device in enumerate(names):
                for start, end, index, clash in lanes[device]:
                    ax.broken_barh([(start - run["t0"], max(end - start, 0.005))], (y - 0.4, 0.8),
                                   facecolors="#e15759" if clash else COLORS[index % len(COLORS)],
                                   edgecolor="white", linewidth=0.4, alpha=0.55 if clash else 0.95)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels([n[:12] + "…" for n in names], fontsize=7)
            ax.set_title(_title(tool, run), fontsize=9, loc="left")
            ax.axvline(run["ideal_makespan_s"], color="black", linestyle=":", linewidth=1)
            ax.set_xlim(left=0)
            ax.tick_params(labelbottom=True)
        axes[-1, 0].set_xlabel("seconds since the first launch (dotted: ideal makespan; red: jobs sharing a device)")
        fig.suptitle(f"Burst on {topology}: one row per device, one bar per job", fontsize=11)
        fig.tight_layout()
        path = out_dir / f"burst-timeline-{topology}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def scale_mpl(plt, results, out_dir):
    scale = results.get("scale")
    if not scale:
        return []
    runs = scale["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, (count, run) in zip(axes[0], runs.items()):
        lanes = _lanes(run["jobs"])
        for y, device in enumerate(sorted(lanes)):
            for start, end, index, clash in lanes[device]:
                ax.broken_barh([(start - run["t0"], end - start)], (y - 0.4, 0.8),
                               facecolors="#e15759" if clash else COLORS[index % len(COLORS)], linewidth=0)
        ax.set_title(f"{count} waiters on {run['devices']} devices: p95 dispatch "
                     f"{run['dispatch']['p95_ms']} ms", fontsize=9)
        ax.set_xlabel("seconds since the first lease was released")
        ax.set_ylabel("device")
    fig.tight_layout()
    path = out_dir / "scale-timeline.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def launch_mpl(plt, results, out_dir):
    launch = results.get("launch")
    if not launch:
        return []
    fig, axes = plt.subplots(1, len(launch), figsize=(6 * len(launch), 4), squeeze=False)
    for ax, (topology, data) in zip(axes[0], launch.items()):
        names = list(data["methods"])
        values = [data["methods"][n]["median_ms"] for n in names]
        bars = ax.barh(range(len(names)), values, color=[COLORS[i % len(COLORS)] for i in range(len(names))])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        for bar, value in zip(bars, values):
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {value:.1f}", va="center", fontsize=8)
        ax.set_xlabel("median launch time, ms")
        ax.set_title(f"{topology} ({data['devices']} devices)", fontsize=10)
    fig.tight_layout()
    path = out_dir / "launch-overhead.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def nvml_mpl(plt, results, out_dir):
    nvml = results.get("nvml")
    if not nvml:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    delays = nvml["slow_init_ms"]
    for i, (tool, per) in enumerate(nvml["launch_median_ms"].items()):
        ax.plot(delays, [per.get(str(d)) for d in delays], marker="o", color=COLORS[i % len(COLORS)], label=tool)
    ax.plot(delays, delays, linestyle=":", color="grey", label="slow_init itself")
    ax.set_xlabel("nvmlInit time (fault slow_init), ms")
    ax.set_ylabel("median launch time, ms")
    ax.legend(fontsize=8)
    ax.set_title(f"Launch time against NVML init ({nvml['topology']})", fontsize=10)
    fig.tight_layout()
    path = out_dir / "nvml-slow-init.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def timelines_svg(results, out_dir):
    """The burst timelines without matplotlib: one SVG per topology."""
    written = []
    width, left, row_h, gap = 1000, 120, 14, 36
    for topology, data in results.get("burst", {}).items():
        parts = []
        y = 20
        for tool, run in data["tools"].items():
            lanes = _lanes(run["jobs"])
            horizon = max([run["ideal_makespan_s"]] + [e - run["t0"] for spans in lanes.values() for _s, e, _i, _c in spans])
            scale = (width - left - 20) / max(horizon, 0.001)
            parts.append(f'<text x="4" y="{y + 12}" font-size="12">{_title(tool, run)}</text>')
            y += 18
            for device in sorted(lanes):
                parts.append(f'<text x="4" y="{y + 11}" font-size="9">{device[:16]}</text>')
                for start, end, index, clash in lanes[device]:
                    x = left + (start - run["t0"]) * scale
                    w = max((end - start) * scale, 1)
                    fill = "#e15759" if clash else COLORS[index % len(COLORS)]
                    parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 2}" '
                                 f'fill="{fill}" fill-opacity="{0.55 if clash else 0.95}" stroke="white"/>')
                y += row_h
            y += gap
        svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y}" '
               f'font-family="sans-serif">\n' + "\n".join(parts) + "\n</svg>\n")
        path = out_dir / f"burst-timeline-{topology}.svg"
        path.write_text(svg)
        written.append(path)
    return written


def main(argv):
    results = json.loads(Path(argv[1]).read_text())
    out_dir = Path(argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        written = timelines_svg(results, out_dir)
    else:
        written = []
        for draw in (timelines_mpl, scale_mpl, launch_mpl, nvml_mpl):
            written += draw(plt, results, out_dir)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
