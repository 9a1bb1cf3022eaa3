"""`cudawrap usage`: the sums (pure), the chart read back from its pixels, and bad input."""
from __future__ import annotations

import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import List

import pytest

from cudawrap.ops.usage import Lease, leases, p95, parse_when, summarize

DAY1 = dt.datetime(2026, 11, 2).timestamp()
DAY2 = dt.datetime(2026, 11, 3).timestamp()
H = 3600.0


def lease(user: str, start: float, hours: float, devices: int = 1, wait: float = 0.0,
          program: str = "recon") -> Lease:
    return Lease(user, program, tuple(f"GPU-{i}" for i in range(devices)), start, start + hours * H, wait, False, 0.0)


def test_device_seconds_count_every_device_and_split_at_midnight() -> None:
    items = [lease("ann", DAY1 + 1 * H, 2, devices=2), lease("ben", DAY2 - 1 * H, 3)]
    by_user = {r["user"]: r for r in summarize(items, "user", DAY1, DAY2 + 24 * H)}
    assert by_user["ann"]["device_seconds"] == 4 * H and by_user["ben"]["device_seconds"] == 3 * H
    by_day = {r["day"]: r for r in summarize(items, "day", DAY1, DAY2 + 24 * H)}
    assert by_day["2026-11-02"]["device_seconds"] == 5 * H and by_day["2026-11-03"]["device_seconds"] == 2 * H
    assert by_day["2026-11-02"]["runs"] == 2 and by_day["2026-11-03"]["runs"] == 0  # a run counts where it began
    by_device = {r["device"]: r for r in summarize(items, "device", DAY1, DAY2 + 24 * H)}
    assert by_device["GPU-0"]["device_seconds"] == 5 * H and by_device["GPU-1"]["device_seconds"] == 2 * H


def test_the_window_clips_leases_and_drops_those_outside() -> None:
    items = [lease("ann", DAY1, 10), lease("ann", DAY1 - 48 * H, 1)]
    rows = summarize(items, "user", DAY1 + 8 * H, DAY1 + 20 * H)
    assert rows == [{"user": "ann", "device_seconds": 2 * H, "device_hours": 2.0, "runs": 1,
                     "wait_mean_s": 0.0, "wait_p95_s": 0.0, "uncertainty_s": 0.0,
                     "memory_gib_hours": None, "memory_peak_gib": None, "idle_device_hours": 0.0}]


def test_waits_mean_and_p95_by_nearest_rank() -> None:
    items = [lease("ann", DAY1 + i, 0.1, wait=float(i)) for i in range(1, 21)]
    row = summarize(items, "program", DAY1, DAY2)[0]
    assert row["program"] == "recon" and row["runs"] == 20
    assert row["wait_mean_s"] == 10.5 and row["wait_p95_s"] == 19.0
    assert p95([]) is None and p95([3.0]) == 3.0


def test_each_lease_once_and_open_ones_only_while_held() -> None:
    grant = {"event": "grant", "id": "a", "user": "ann", "program": "p", "devices": ["GPU-0"], "start": 100.0,
             "wait_s": 1.0}
    end = dict(grant, event="end", end=160.0)
    problems: List[str] = []
    got = leases([grant, grant, end, end, dict(grant, id="b"), dict(grant, id="c")], ["b"], 400.0, problems)
    assert sorted((x.start, x.end, x.running) for x in got) == [(100.0, 160.0, False), (100.0, 400.0, True)]
    assert len(problems) == 1 and "1 lease(s) with a grant but no recorded end" in problems[0]


@pytest.mark.parametrize("text, expected", [
    ("7d", 1_000_000.0 - 7 * 86400), ("12h", 1_000_000.0 - 12 * 3600), ("30m", 1_000_000.0 - 1800),
    ("2026-11-02", DAY1), ("2026-11", dt.datetime(2026, 11, 1).timestamp()),
    ("2026-11-02T06:30", DAY1 + 6.5 * H), ("2026-11-02 06:30:10", DAY1 + 6.5 * H + 10),
])
def test_when(text: str, expected: float) -> None:
    assert parse_when(text, 1_000_000.0, "--since") == expected


# --- the chart, through the command, read back ------------------------------------------------

pytestmark_root = pytest.mark.skipif(os.geteuid() != 0, reason="root reads the ledger")


def write_ledger(path: Path, items: List[Lease]) -> None:
    lines = []
    for n, x in enumerate(items):
        lines.append(json.dumps({"v": 1, "event": "end", "id": f"l{n}", "user": x.user, "uid": 1000 + n,
                                 "program": x.program, "devices": list(x.devices), "start": x.start,
                                 "end": x.end, "wait_s": x.wait_s, "how": "ended"}))
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)


@pytestmark_root
def test_plot_is_a_stacked_bar_chart_of_device_hours_per_user_per_day(installed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import matplotlib.image

    inst = installed("four-gpus")
    # ann: 2 h on day 1; ben: 1 h on day 1 and 3 h on day 2 (as two runs of 1 device and one of 3).
    write_ledger(inst.layout.state_dir / "ledger", [
        lease("ann", DAY1 + 2 * H, 2), lease("ben", DAY1 + 5 * H, 1), lease("ben", DAY2 + 5 * H, 1, devices=3)])
    out = tmp_path / "month.png"
    done = inst.cli("usage", "--since", "2026-11-02", "--until", "2026-11-04", "--plot", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert {r["user"]: r["device_hours"] for r in json.loads(done.stdout)} == {"ann": 2.0, "ben": 4.0}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(str(out))[:, :, :3]
    colours = {"ann": (0x1F, 0x77, 0xB4), "ben": (0xFF, 0x7F, 0x0E)}  # tab10's first two, users sorted

    def columns(rgb: tuple) -> dict:
        """x -> how many pixels of RGB in that column (a bar's height in pixels)."""
        import numpy

        mask = (abs(pixels * 255 - numpy.array(rgb)) < 3).all(axis=2)
        counts = mask.sum(axis=0)
        return {x: int(c) for x, c in enumerate(counts) if c > 5}

    ann, ben = columns(colours["ann"]), columns(colours["ben"])
    # Bars: ann has one (day 1), ben two (day 1 above ann's, day 2); take each bar's middle column.
    def bars(cols: dict) -> List[int]:
        xs = sorted(cols)
        groups: List[List[int]] = [[xs[0]]]
        for x in xs[1:]:
            (groups[-1].append(x) if x == groups[-1][-1] + 1 else groups.append([x]))
        return [cols[g[len(g) // 2]] for g in groups if len(g) > 3]

    # The legend's patches are small squares: bars are the tall runs of columns.
    ann_bars, ben_bars = [h for h in bars(ann) if h > 20], [h for h in bars(ben) if h > 20]
    assert len(ann_bars) == 1 and len(ben_bars) == 2, (bars(ann), bars(ben))
    unit = ann_bars[0] / 2.0  # pixels per device-hour
    assert abs(ben_bars[0] / unit - 1.0) < 0.1 and abs(ben_bars[1] / unit - 3.0) < 0.1, (ann_bars, ben_bars)


@pytestmark_root
def test_plot_without_matplotlib_says_how_to_install_it(installed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    inst = installed("four-gpus")
    code = "import sys; sys.modules['matplotlib'] = None; from cudawrap.cli import main; main()"
    done = inst.run(sys.executable, "-c", code, "usage", "--plot", str(tmp_path / "x.png"))
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 65 and "--plot needs matplotlib" in lines[0], lines
    assert "--with-plot" in lines[1] and len(lines) == 2
    assert not (tmp_path / "x.png").exists()


def test_idle_device_hours_come_from_the_idle_notes_per_user_device_and_day() -> None:
    from cudawrap.ops.usage import idle_spells

    notes = [{"event": "idle", "device": "GPU-0", "at": DAY1 + 3 * H, "user": "ann", "program": "recon",
              "start": DAY1 + 1 * H, "end": DAY1 + 3 * H},
             {"event": "idle", "device": "GPU-1", "at": DAY2 + H, "user": "ann", "program": "recon",
              "start": DAY2 - H, "end": DAY2 + H},
             {"event": "idle", "device": "GPU-1", "at": DAY1, "user": "ben", "start": "?", "end": DAY1},
             {"event": "end", "id": "x"}]
    spells = idle_spells(notes)
    assert len(spells) == 2  # the one without a start is not counted
    items = [lease("ann", DAY1, 10), lease("ben", DAY1, 1)]
    by_user = {r["user"]: r for r in summarize(items, "user", DAY1, DAY2 + 24 * H, spells)}
    assert by_user["ann"]["idle_device_hours"] == 4.0 and by_user["ben"]["idle_device_hours"] == 0.0
    by_day = {r["day"]: r["idle_device_hours"] for r in summarize(items, "day", DAY1, DAY2 + 24 * H, spells)}
    assert by_day == {"2026-11-02": 3.0, "2026-11-03": 1.0}
    by_device = {r["device"]: r["idle_device_hours"] for r in summarize(items, "device", DAY1, DAY1 + 2 * H, spells)}
    assert by_device == {"GPU-0": 1.0}  # clipped to the window
