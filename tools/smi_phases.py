"""SM clock and board power per phase of a run, from nvidia-smi samples.

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \
        --format=csv,noheader -lms 100 > smi.csv &
    echo "$(date +%H:%M:%S.%N) NAME start" >> phases.txt; ...; echo "... NAME end" >> phases.txt
    python3 tools/smi_phases.py smi.csv phases.txt

Only samples drawing more than BUSY_WATTS count (compilation and host work between calls leave
the GPU near idle). Shows whether a phase ran at the boost clock or below it (power or heat).
"""

from __future__ import annotations

import statistics
import sys
from datetime import datetime

BUSY_WATTS = 300.0


def seconds_of_day(clock: str) -> float:
    """'HH:MM:SS.fraction' -> seconds since midnight."""
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def read_samples(path: str) -> list[tuple[float, float, float, float]]:
    """(time, SM MHz, watts, °C) per line of `--format=csv,noheader`."""
    rows = []
    for line in open(path, encoding="utf-8"):
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            stamp = datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f")
            mhz = float(fields[1].split()[0])
            watts = float(fields[2].split()[0])
            celsius = float(fields[3])
        except ValueError:
            continue
        day = stamp.hour * 3600 + stamp.minute * 60 + stamp.second + stamp.microsecond / 1e6
        rows.append((day, mhz, watts, celsius))
    return rows


def read_phases(path: str) -> list[tuple[str, float, float]]:
    """(name, start, end) from lines 'HH:MM:SS.ns NAME start|end'."""
    starts, phases = {}, []
    for line in open(path, encoding="utf-8"):
        clock, name, edge = line.split()
        t = seconds_of_day(clock[:15])  # date +%N gives 9 digits; microseconds are plenty
        if edge == "start":
            starts[name] = t
        else:
            phases.append((name, starts.pop(name), t))
    return phases


def main(smi_csv: str, phases_txt: str) -> None:
    samples = read_samples(smi_csv)
    print(f"samples above {BUSY_WATTS:.0f} W")
    print("phase  samples  SM MHz median (min-max)  W median (max)  °C max")
    for name, start, end in read_phases(phases_txt):
        busy = [s for s in samples if start <= s[0] <= end and s[2] > BUSY_WATTS]
        if not busy:
            print(f"{name:6s} {0:7d}")
            continue
        mhz, watts, celsius = ([s[i] for s in busy] for i in (1, 2, 3))
        clock = f"{statistics.median(mhz):.0f} ({min(mhz):.0f}-{max(mhz):.0f})"
        power = f"{statistics.median(watts):.0f} ({max(watts):.0f})"
        print(f"{name:6s} {len(busy):7d}  {clock:23s}  {power:14s}  {max(celsius):6.0f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
