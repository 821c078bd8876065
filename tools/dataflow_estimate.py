"""What the fused kernel would take with one grid barrier per iteration, every other step
ordered by the data it reads, estimated from an on-device profiler trace (as
`experiments.kernels.scopes` reads it) of huginn-0125's Core at batch 1, two attention splits per
head on 132 workers:

    python3 tools/dataflow_estimate.py TRACE.json[.gz] [--latencies=0,1000,2000,3000]
        [--ms_per_iteration=MS] [--polls=0,500,1000,2000]

Each worker's measured cycles per step (its units of a product, its attention item) are kept and
each iteration is replayed from every worker at cycle 0, three ways:
- with a grid barrier after every step, as the kernel runs them (each step starts when the
  slowest worker has ended the one before, plus `BARRIER` cycles): the check that the replay
  adds up to the measured iteration;
- every worker's steps back to back, no wait (what leaving every barrier out would give);
- ordered by data: a worker takes its units of a product in order at its measured rate per
  unit, and a unit waits until the output tile of the step before that holds its input chunk is
  complete (every worker whose units cover that tile has ended its units there) plus a latency
  (the partial sums' reduce-add, a counter's signal and its poll); an attention item waits for
  the qkv tiles of its head's q, k and v windows, proj's units for the heads whose value windows
  cover their chunk; a step whose first unit applies a norm's scalar (the attention, the MLP
  proj) also waits until every worker has ended the step whose output that norm is of; the
  iteration ends at one barrier. A wait delays the worker's later units by as much, or, where
  the ring catches up, only until the units whose weights landed during it are done
  (`run_units`).
A worker's rate per unit is kept wherever its range starts, so the last replay estimates rather
than bounds what such a schedule would take. The first and last are also replayed with every
worker at its product's median rate (`evened`): what an even split of each product's time, not
of its units, would add to either.

The waits on the tile counters (`--polls`): each unit that waits on a counter
(`fused_plan.waits_on_counter`) holds its worker that many cycles more, even where its input is
ready: before the unit's ring slot is freed, as the kernel's default issues the wait, or after
(`Schedule.late_inputs`), where it delays the worker's next unit but not the slot's next copy;
and with `Schedule.counter_tiles` 4 a unit waits on 4 output tiles of the product before it
where it waited on 1, a quarter as often.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from experiments.kernels import scopes
from experiments.measure.trace import load_trace
from huginn_jax.config import huginn_0125
from huginn_jax.persistent import fused_shape
from pallas_kernels.core_step.fused_counters import input_counters
from pallas_kernels.core_step.fused_plan import Schedule, waits_on_counter
from pallas_kernels.core_step.plan import UNIT, even_share

SHAPE = fused_shape(huginn_0125, batch=1)
WORKERS, SPLITS = 132, 2
BARRIER = 2139  # cycles of a grid barrier where every worker arrives at once (stream_units.txt)
OWN = 1065  # cycles of a worker's own work on a unit whose weights are in L2 (stream_units.txt)
COPY = 1792  # cycles of a unit's copy from HBM in the bare stream (stream_units.txt)
RING = 3  # weight units in flight per worker (the kernel's default)
X_STAGES = 2  # input chunks in flight per worker (the kernel's)


@dataclasses.dataclass(frozen=True)
class Polls:
    """The counter waits of a replay (the module's docstring): `cycles` each, issued after the
    unit's slot is freed (`late`), on counters of `counter_tiles` tiles."""

    cycles: float = 0.0
    late: bool = False
    counter_tiles: int = 1

    def waits(self, p: int):
        """i, kc -> whether the worker's i-th unit of product p (input chunk kc) waits."""
        schedule = Schedule(counter_tiles=self.counter_tiles)
        rows, span = input_counters(SHAPE, schedule, p)
        return lambda i, kc: bool(p) and waits_on_counter(i, -1, kc, rows, span)


def run_units(phase, starts, rates, ready_of_chunk, catch_up: bool, polls: Polls | None = None):
    """(each worker's end, each output tile's completion) of `phase` where unit (t, kc) waits
    until ready_of_chunk(kc). Without `catch_up` a wait delays every later unit by as much;
    with it, the weights of the units in the worker's ring landed during the wait, so those
    take only the worker's own work (`OWN` cycles) until a slot freed after the wait brings the
    next unit (`COPY` cycles after it was freed). With `polls` (and `catch_up`): `run_polled`."""
    if polls is not None:
        if not catch_up:
            raise ValueError("the counter waits are replayed with the ring catching up only")
        return run_polled(phase, starts, rates, ready_of_chunk, polls)
    units, per_tile = phase.units(SHAPE.unit_cols), phase.k_chunks
    tiles = [0.0] * (units // per_tile)
    ends = []
    for w in range(WORKERS):
        first, end = even_share(units, WORKERS, w)
        rate = rates[w]
        own = min(OWN, rate)  # never slower than the worker's measured rate
        done = [starts[w]]  # each unit's end, after the worker's start
        landed = starts[w] - own  # unit u's weights in shared memory, without waits
        for u in range(first, end):
            t, kc = divmod(u, per_tile)
            landed += rate
            if catch_up:
                freed = done[-RING] if len(done) > RING else -1e30
                landed = max(landed, freed + COPY)
                time = max(landed, done[-1], ready_of_chunk(kc)) + own
            else:
                time = max(done[-1] + rate, ready_of_chunk(kc) + rate)
            done.append(time)
            tiles[t] = max(tiles[t], time)
        ends.append(done[-1])
    return ends, tiles


def run_polled(phase, starts, rates, ready_of_chunk, polls: Polls):
    """`run_units` with the ring catching up, where each unit's input is waited for as the
    kernel does it: `X_STAGES` units ahead (the first `X_STAGES` at the product's start), the
    worker held until the input is ready and, where the unit waits on a counter, for a poll of
    `polls.cycles` at least; before the unit then running's ring slot is freed, or after it
    (`polls.late`)."""
    units, per_tile = phase.units(SHAPE.unit_cols), phase.k_chunks
    waits = polls.waits(SHAPE.phases.index(phase))
    tiles = [0.0] * (units // per_tile)
    ends = []
    for w in range(WORKERS):
        first, end = even_share(units, WORKERS, w)
        rate, n = rates[w], end - first
        own = min(OWN, rate)

        def held(now, i, first=first, n=n):  # after the wait for unit i's input, from `now`
            if i >= n:
                return now
            kc = (first + i) % per_tile
            poll = polls.cycles if waits(i, kc) else 0.0
            return max(now + poll, ready_of_chunk(kc))

        now = starts[w]
        for i in range(min(X_STAGES, n)):
            now = held(now, i)
        done, freed_at = [now], [now]
        landed = starts[w] - own
        for i in range(n):
            t = (first + i) // per_tile
            landed = max(landed + rate, (freed_at[-RING] if len(freed_at) > RING else -1e30) + COPY)
            if polls.late:
                slot_free = max(landed, done[-1]) + own
                time = held(slot_free, i + X_STAGES)
            else:
                slot_free = time = max(landed, held(done[-1], i + X_STAGES)) + own
            done.append(time)
            freed_at.append(slot_free)
            tiles[t] = max(tiles[t], time)
        ends.append(done[-1])
    return ends, tiles


STEPS = ["adapter"] + [
    f"{kind}{j}" for j in range(SHAPE.layers) for kind in ("qkv", "attn", "proj", "fc", "mlp_proj")
]  # an iteration's steps in order
PHASES = {p.name: p for p in SHAPE.phases}
SHARES = {  # per product, each worker's units (`even_share`)
    name: [
        e - f for f, e in (even_share(p.units(SHAPE.unit_cols), WORKERS, w) for w in range(WORKERS))
    ]
    for name, p in PHASES.items()
}


def _cycles(occ: dict, name: str, it: int) -> list[float]:
    """Each worker's cycles in step `name` of iteration `it`."""
    o = occ[name][it]
    return [o[w + 1] for w in range(WORKERS)]


def barrier_replays(occ: dict, it: int) -> tuple[float, float]:
    """Cycles of iteration `it` with a barrier after every step, and with every worker's steps
    back to back and no wait (one barrier)."""
    cycles = [_cycles(occ, s, it) for s in STEPS]
    barriers = sum(max(c) + BARRIER for c in cycles)
    return barriers, max(sum(c) for c in zip(*cycles, strict=True)) + BARRIER


def data_replay(
    occ: dict, it: int, latency: float, catch_up: bool, polls: Polls | None = None
) -> float:
    """Cycles of iteration `it` ordered by data, one barrier (the module's docstring)."""
    cols, d, kp = SHAPE.unit_cols, SHAPE.d, SHAPE.kp

    def run(name, starts, ready_of_chunk):
        rates = [c / max(1, n) for c, n in zip(_cycles(occ, name, it), SHARES[name], strict=True)]
        return run_units(PHASES[name], starts, rates, ready_of_chunk, catch_up, polls)

    def from_tiles(tiles, rows: int, after: float = 0.0):
        """kc -> when input chunk kc (`rows` rows of the step before's output) is ready: the
        `counter_tiles` tiles counted with its tile."""
        group = polls.counter_tiles if polls else 1
        counted = [max(tiles[t - t % group : t - t % group + group]) for t in range(len(tiles))]
        return lambda kc: max(counted[kc * rows // cols] + latency, after)

    ends, tiles = run("adapter", [0.0] * WORKERS, lambda kc: 0.0)
    norm_source_end = max(ends)  # the step whose output the next attention's norm is of
    for j in range(SHAPE.layers):
        ends, qkv_tiles = run(f"qkv{j}", ends, from_tiles(tiles, UNIT))
        attention = _cycles(occ, f"attn{j}", it)
        head_done = []
        for h in range(SHAPE.heads):
            ck, c0 = SHAPE.key_window(h)[0], SHAPE.head_window(h)[0]
            rows = (ck, ck + kp - 1, d + ck, d + ck + kp - 1, 2 * d + c0, 2 * d + c0 + kp - 1)
            ready = max(max(qkv_tiles[r // cols] for r in rows), norm_source_end) + latency
            workers = [h * SPLITS + s for s in range(SPLITS)]
            start = max(max(ends[w] for w in workers), ready)
            head_done.append(start + attention[workers[0]])
            for w in workers:
                ends[w] = start + attention[w]
        att_ready = [
            max((head_done[h] + latency for h in heads), default=0.0) for heads in ATT_HEADS
        ]
        ends, tiles = run(f"proj{j}", ends, att_ready.__getitem__)
        gate_ready = max(ends) + latency  # the SiLU gate's norms are of fc's input
        ends, tiles = run(f"fc{j}", ends, from_tiles(tiles, UNIT))
        ready = from_tiles(tiles, 2 * UNIT, gate_ready)  # a chunk: 64 gate rows and 64 up rows
        ends, tiles = run(f"mlp_proj{j}", ends, ready)
        norm_source_end = max(ends)
    return max(ends) + latency + BARRIER


def _heads_of_chunks() -> list[list[int]]:
    """Per 64-row chunk of the attention output, the heads whose value windows
    (`FusedShape.head_window`, kp rows each, added whole) meet it."""
    kp = SHAPE.kp
    starts = [SHAPE.head_window(h)[0] for h in range(SHAPE.heads)]
    return [
        [h for h, c0 in enumerate(starts) if c0 < (kc + 1) * UNIT and c0 + kp > kc * UNIT]
        for kc in range(SHAPE.k_d // UNIT)
    ]


ATT_HEADS = _heads_of_chunks()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument(
        "--latencies", default="0,1000,2000,3000",
        help="cycles from a tile's last unit to its reader's start, a list",
    )  # fmt: skip
    parser.add_argument(
        "--polls", default="",
        help="cycles each counter wait holds its worker, a list (none: no such table)",
    )  # fmt: skip
    parser.add_argument(
        "--ms_per_iteration", type=float, default=0.0,
        help="the traced kernel's device time per iteration: also print ms at the trace's clock",
    )  # fmt: skip
    args = parser.parse_args()
    trace = load_trace(args.trace)
    occ = scopes.occurrences(trace)
    iterations = len(occ["adapter"])
    spans = [
        (max(e["ts"] for e in evs) - min(e["ts"] for e in evs)) * 1e3 / iterations
        for evs in _events_by_worker(trace).values()
    ]
    measured = statistics.median(spans)
    scale = args.ms_per_iteration / measured if args.ms_per_iteration else 0.0

    def line(what: str, cycles: float, base: float) -> None:
        ms = f"  {cycles * scale:6.3f} ms" if scale else ""
        print(f"{what:58s} {cycles:9.0f}{ms}  {cycles / base:6.3f}")

    even = evened(occ)

    def median_of(replayed, *args, source=occ):
        return statistics.median(replayed(source, it, *args) for it in range(iterations))

    def barriers_of(source, it):
        return barrier_replays(source, it)[0]

    barriers = median_of(barriers_of)
    no_wait = median_of(lambda source, it: barrier_replays(source, it)[1])
    print(f"per iteration, median over {iterations}; last column: / the barriers' replay")
    line(f"measured (a worker's trace span / {iterations})", measured, barriers)
    line("replayed, a grid barrier after every step", barriers, barriers)
    line("replayed, every worker's steps back to back, no wait", no_wait, barriers)
    latencies = [float(x) for x in args.latencies.split(",")]
    for latency in latencies:
        for catch_up in (False, True):
            how = "ring catches up" if catch_up else "no catch-up"
            line(
                f"replayed ordered by data, latency {latency:.0f}, {how}",
                median_of(data_replay, latency, catch_up),
                barriers,
            )
    polls = [float(x) for x in args.polls.split(",")] if args.polls else []
    if polls:
        print(f"counter waits: ordered by data, latency {latencies[0]:.0f}, ring catches up")
        heads = ("default", "late", "4 tiles", "both")
        print("  poll cycles " + "".join(f"{h:>{20 if scale else 11}s}" for h in heads))
    for cycles in polls:
        replays = [
            median_of(data_replay, latencies[0], True, Polls(cycles, late, tiles))
            for tiles in (1, 4)
            for late in (False, True)
        ]
        each = "".join(f"{r:11.0f}{f' {r * scale:5.3f} ms' if scale else ''}" for r in replays)
        print(f"  {cycles:11.0f} {each}")
    print("every worker at its product's median rate per unit (`evened`):")
    line("  a grid barrier after every step", median_of(barriers_of, source=even), barriers)
    for latency in latencies:
        line(
            f"  ordered by data, latency {latency:.0f}, ring catches up",
            median_of(data_replay, latency, True, source=even),
            barriers,
        )


def evened(occ: dict) -> dict:
    """`occ` with every worker's cycles in each product (not the attention) replaced by its
    units at the median worker's cycles per unit in that occurrence: the products split
    evenly by time rather than by units."""
    out = dict(occ)
    for name, shares in SHARES.items():
        out[name] = []
        for o in occ[name]:
            rate = statistics.median(o[w + 1] / max(1, shares[w]) for w in range(WORKERS))
            out[name].append({w + 1: rate * max(1, shares[w]) for w in range(WORKERS)})
    return out


def _events_by_worker(trace: dict) -> dict:
    """{worker: its first warpgroup's B and E events}."""
    out: dict = {}
    for worker, e in scopes.worker_events(trace):
        out.setdefault(worker, []).append(e)
    return out


if __name__ == "__main__":
    main()
