"""The static layout of the fused Core decode kernel (`fused.py`): shapes, schedules, buffers,
scalar rows, and each worker's units (its shared memory: `fused_fit.py`).

Activations are kept transposed, [rows, 8] float32 (row = feature, column = sequence of the
batch, padded to the wgmma N of 8), in one array of buffers `act` (`Buffers`). Per-row scalars
(sums of squares) live in the rows of a [64, 8] tile (`ScalarRows`), two tiles used in turn by
the iterations. Every product's k is padded to 64 and n to the tile width, as the weight stream's
(`plan.py`); the qkv output has 8 rows of padding before and after, so that RoPE can read each
row's neighbour with a shifted window.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels.core_step.plan import (
    UNIT,
    Phase,
    check_unit_cols,
    even_share,
    pad_to,
    pad_unit,
)

N_PAD = 8  # batch columns of every activation tile: the wgmma N
MAX_BATCH = N_PAD
BLOCK = 64  # cached positions per attention block, by default
KV_BLOCKS = (64, 128)  # the blocks the attention can step by (Schedule.kv_block)
SHIFT = 8  # rows of padding around the qkv output (RoPE reads row r - 1 and r + 1)
SCALAR_ROWS = 64
BUFFER_KINDS = ("qkv", "att", "o", "fc", "m")
PRODUCT_KINDS = ("adapter", "qkv", "proj", "fc", "mlp_proj")  # the phases' names less the layer
STEP_KINDS = (*PRODUCT_KINDS, "attn")  # the steps a grid barrier can follow
DEFAULT_UNIT_COLS = 256  # output columns of the kernel's [64, unit_cols] weight units


def widest_tile(step: int) -> int:
    """The widest swizzle tile (64, 32 or 16 bf16 columns) that divides `step` columns."""
    return next((c for c in (64, 32) if step % c == 0), 16)


def kind_of(name: str) -> tuple[str, int]:
    """("qkv", 2) of the phase "qkv2"; ("adapter", -1)."""
    kind = name.rstrip("0123456789")
    return kind, int(name[len(kind) :]) if kind != name else -1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How the kernel keeps its reads in flight (`fused.build_fused_core`): `ring` weight units
    per worker into shared memory, the unit `l2_units` further on into L2, `kv_stages` cached
    key blocks of `kv_block` positions in the attention (one block per softmax step) and
    `value_stages` value blocks (0: as many as key blocks, `stages_of_values`), each
    attention item's first `l2_blocks` blocks into L2 ahead of it; once a worker has arrived
    at the barrier after a product, the next product's `l2_barrier` units after the ring's into
    L2 (`l2_attention` after a qkv, whose barrier the attention follows). `handover` > 0:
    after a proj, and after an MLP proj that a qkv follows, a worker takes that many units of
    the next product as soon as their input tiles are complete (per-tile counters), and only
    then waits for every worker to have finished the step before (0: a grid barrier).
    `overlap` 1: each qkv streams q's columns first, and a second warpgroup per worker runs
    its attention item's cached blocks while the first streams the k and v columns (the new
    position and the splits' combine stay after the barrier; one item per worker at most).
    `dataflow` 1: one grid barrier per iteration, after its last product; every other step
    waits on counters for the data it reads (`fused_counters.py`; `handover` then unused).
    `head_pairs` 1: each attention item takes two neighbouring heads, whose 2 head_dim cached
    columns are whole tiles, so that the value blocks are read without the columns a head's
    window holds beyond its own (`FusedShape.pair_window`; not with overlap or dataflow).
    `lag`: wgmmas in flight behind a unit's; a unit's ring slot takes its next copy once the
    wgmma `lag` units later is issued and its own is done (0: at once, one more copy in flight
    while the worker waits for a unit; 1: that wgmma overlaps the next unit's input).
    `late_inputs` 1: a unit issues the input copy `x_stages` units ahead (and that copy's wait
    on a tile counter) after its own wgmma and the ring slot's release, where 0 issues it
    before the unit's weight wait: a wait on a counter then never holds back the weight
    stream's next copy.
    `counter_tiles`: output tiles per counter of the products that another product reads
    (`fused_counters.py`): their readers wait once per that many tiles of their input, on the
    completion of them all (1: one counter per tile).
    The attention's key and value blocks are copied on barriers of their own: a (sequence,
    block) pair's key block `kv_stages` - 1 pairs ahead, its value block `stages_of_values` - 1
    ahead, and a softmax step waits for its value block only before the weighted values (its
    scores need the key block alone). With `value_stages` 2 beside 3 key stages, a third key
    block in flight fits where a third of each does not.
    `l2_keep` > 0: each worker marks that many of its adapter units, those from the ring's
    depth on (the first it copies after the iteration's barrier), evict_last in L2 once taken,
    in every iteration after the first (whose adapter is the raw one), so that the next
    iteration may read them from L2 rather than HBM (`pallas_kernels.l2.mark_in_l2`; at most
    the adapter units a worker copies after the ring's, `fused_fit.check_fused`).
    `known_complete` 1 (with `overlap` and `dataflow`): a head's attention step leaves out its
    waits on the counters that are complete before it starts, those of q's tiles (the qkv's
    first `FusedShape.q_tiles`) and of the layer input's norms: the worker's second warpgroup
    waited for every worker's q units (`q_done`), which each worker puts out after its chunks
    of the norms, before the partials that the step waits for (`fused_counters.wait_head`).
    Written as `FORMAT` says, RING:KV_STAGES[:L2_UNITS[...]] (`parse`, `str`). The defaults are
    the kernel's, for its default [64, 256] weight units: the shared memory bounds ring x unit
    width and kv_stages x kv_block together (3:3, 3:4, 4:2, 4:3 and 3:2 with blocks of 128 fit
    at [64, 256] units, 6:4 and 8:3 at [64, 128]; docs/core_step.md: how they compare), and the
    L2 prefetches were slower than none."""

    ring: int = 3
    kv_stages: int = 3
    l2_units: int = 0
    l2_blocks: int = 0
    kv_block: int = BLOCK
    l2_barrier: int = 0
    l2_attention: int = 0
    handover: int = 8
    overlap: int = 0
    dataflow: int = 0
    head_pairs: int = 0
    lag: int = 1
    late_inputs: int = 0
    counter_tiles: int = 1
    value_stages: int = 0
    l2_keep: int = 0
    known_complete: int = 0

    @property
    def stages_of_values(self) -> int:
        """Cached value blocks in flight: `value_stages`, or as many as key blocks."""
        return self.value_stages or self.kv_stages

    @property
    def l2_reach(self) -> int:
        """Units past the ring that the furthest of the weight prefetches reaches."""
        return max(self.l2_units, self.l2_barrier, self.l2_attention)

    def __post_init__(self):
        if self.kv_block not in KV_BLOCKS:
            raise ValueError(f"kv_block={self.kv_block} must be one of {KV_BLOCKS}")

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """6:3, 6:3:16:8, 4:2:0:0:128 or 3:3:0:0:64:0:0:0 (the fields left out take their
        defaults); ValueError otherwise."""
        parts = text.split(":")
        fields = len(dataclasses.fields(cls))
        if not 2 <= len(parts) <= fields or not all(p.isdigit() for p in parts):
            raise ValueError(f"{text!r} is not {FORMAT} (6:3:16:8)")
        return cls(*(int(p) for p in parts))

    def __str__(self) -> str:
        values = list(dataclasses.astuple(self))
        defaults = [f.default for f in dataclasses.fields(self)]
        while len(values) > 2 and values[-1] == defaults[len(values) - 1]:
            values.pop()
        return ":".join(map(str, values))


DEFAULT_SCHEDULE = Schedule()


def _format() -> str:
    names = [f.name.upper() for f in dataclasses.fields(Schedule)]
    optional = "".join(f"[:{name}" for name in names[2:])
    return f"{names[0]}:{names[1]}{optional}{']' * (len(names) - 2)}"


FORMAT = _format()  # RING:KV_STAGES[:L2_UNITS[...]]: a schedule as `Schedule.parse` reads it


@dataclasses.dataclass(frozen=True)
class FusedShape:
    """A Core of `layers` sandwich blocks: d = heads * head_dim, MLP width `intermediate`."""

    d: int
    heads: int
    head_dim: int
    intermediate: int
    layers: int
    batch: int
    unit_cols: int = DEFAULT_UNIT_COLS

    def __post_init__(self):
        check_unit_cols(self.unit_cols)
        if self.heads * self.head_dim != self.d:
            raise ValueError(f"d={self.d} must be heads * head_dim")
        if self.head_dim % 2 or self.kp > 128 or self.kp > self.d:
            raise ValueError(
                f"head_dim={self.head_dim} must be even, padded to 64 at most 128 and at most d"
            )
        if not 1 <= self.batch <= MAX_BATCH:
            raise ValueError(f"batch={self.batch} must be in [1, {MAX_BATCH}]")
        if not 1 <= self.layers or 1 + 4 * self.layers > SCALAR_ROWS:
            raise ValueError(f"layers={self.layers} must be in [1, {(SCALAR_ROWS - 1) // 4}]")

    @property
    def kp(self) -> int:
        """A head's rows as the kernel holds them: head_dim padded to 64."""
        return pad_unit(self.head_dim)

    @property
    def k_d(self) -> int:
        return pad_unit(self.d)

    @property
    def n_d(self) -> int:
        return pad_to(self.d, self.unit_cols)

    @property
    def k_i(self) -> int:
        """Rows of the MLP's gate and of its up half in the fc output (and the mlp proj's k)."""
        return pad_unit(self.intermediate)

    @property
    def phases(self) -> tuple[Phase, ...]:
        """The products of one iteration: adapter (the state half), then per layer qkv, proj,
        fc ([gate | up], each padded to k_i), mlp proj."""
        cols = self.unit_cols
        out = [Phase("adapter", self.k_d, self.n_d)]
        for j in range(self.layers):
            out += [
                Phase(f"qkv{j}", self.k_d, pad_to(3 * self.d, cols)),
                Phase(f"proj{j}", self.k_d, self.n_d),
                Phase(f"fc{j}", self.k_d, pad_to(2 * self.k_i, cols)),
                Phase(f"mlp_proj{j}", self.k_i, self.n_d),
            ]
        return tuple(out)

    def weight_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The kernel's weight inputs, one per kind of product (`PRODUCT_KINDS`), each
        [layers, n / cols, k, cols] (`fused_step.tile_columns` per layer): the adapter's two
        versions in place of layers. One array per kind, not per product, is one TMA descriptor
        per kind: every descriptor is built on the host at each call."""
        cols = self.unit_cols
        tiled = {kind_of(p.name)[0]: (p.n // cols, p.k, cols) for p in self.phases}
        return tuple(
            (2 if kind == "adapter" else self.layers, *tiled[kind]) for kind in PRODUCT_KINDS
        )

    def head_window(self, head, minimum=min) -> tuple:
        """(c0, delta): head `head`'s kp-row window starts at column c0 of its section (the
        last heads' windows end at d), and the head's rows are [delta, delta + head_dim) of it.
        The values' cached blocks are read as these windows: the weighted values' wgmma takes
        the block as its A operand, whose rows (the head's columns) come in 64s. `minimum`:
        jnp.minimum where `head` is traced (in the kernel)."""
        c0 = minimum(head * self.head_dim, self.d - self.kp)
        return c0, head * self.head_dim - c0

    @property
    def attention_tile(self) -> int:
        """Columns of a tile of the attention's shared-memory operands: the widest swizzle's
        (64, 32 or 16 columns) that divides every head window's first column (h * head_dim, or
        d - kp for the last heads), so that a window is whole tiles."""
        return widest_tile(math.gcd(self.head_dim, self.d - self.kp))

    @property
    def key_cols(self) -> int:
        """Columns of a cached key block as the kernel reads it: the head's own (head_dim)
        where they are whole tiles, else its kp-row window. The scores' wgmma takes the block
        as its A operand, whose columns (k) come in tiles: huginn-0125's 96 columns are three
        tiles of 32, a quarter fewer bytes than the window of 128."""
        return self.head_dim if self.head_dim % self.attention_tile == 0 else self.kp

    def key_window(self, head, minimum=min) -> tuple:
        """(c0, delta) of the window that q, k and the cached keys share: the head's own
        columns (delta 0) where `key_cols` is head_dim, else `head_window`. Its kp rows may
        pass d by kp - head_dim (the RoPE tables have `table_rows`)."""
        if self.key_cols == self.head_dim:
            return head * self.head_dim, 0
        return self.head_window(head, minimum)

    @property
    def pair_cols(self) -> int:
        """Columns of a two-head item's window (`Schedule.head_pairs`): 2 head_dim."""
        return 2 * self.head_dim

    @property
    def pairs(self) -> int:
        """Two-head items' windows: one per two heads, the last of an odd number of heads
        with the head before it (`pair_window`)."""
        return -(-self.heads // 2)

    def pairs_unfit(self) -> str:
        """Why this shape cannot take two-head items ('' where it can): their windows and
        the slices of them that the wgmmas take must be whole tiles of 32 columns."""
        if self.head_dim % 32 or self.heads < 2:
            return (
                f"two-head items need a head_dim that is a multiple of 32 and 2 heads at least "
                f"(head_dim={self.head_dim}, heads={self.heads})"
            )
        return ""

    def pair_window(self, pair, minimum=min):
        """The first column of two-head item `pair`'s window of `pair_cols` columns: heads
        2 pair and 2 pair + 1, where the last window of an odd number of heads ends at d and
        holds the head before the last too (its first slot, whose head another pair has). Its
        key blocks take head slot e's columns [e head_dim, (e + 1) head_dim), its value blocks
        the kp columns from `pair_slot_start(e)`. `minimum`: jnp.minimum where traced."""
        return minimum(pair * self.pair_cols, self.d - self.pair_cols)

    def pair_slot_start(self, slot: int) -> int:
        """The first column, in a two-head window, of slot `slot`'s kp value columns: the
        window's first kp, or its last kp."""
        return slot * (self.pair_cols - self.kp)

    def value_window(self, head, head_pairs: bool, minimum=min) -> tuple:
        """(c0, delta) of the kp-row window that holds head `head`'s value rows (of the
        attention output, the new v row, the weighted values): `head_window`, or with
        two-head items the value slice of its pair's window at its slot."""
        if not head_pairs:
            return self.head_window(head, minimum)
        first = self.pair_window(head // 2, minimum)
        c0 = first + self.pair_slot_start((head * self.head_dim - first) // self.head_dim)
        return c0, head * self.head_dim - c0

    def operand_tile(self, head_pairs: bool) -> int:
        """Columns of a tile of the attention's shared-memory operands: `attention_tile`,
        or with two-head items the widest that divides the pair windows' first columns and the
        slices' (head_dim, `pair_slot_start(1)`): 32 or 64 where `pairs_unfit` is ''."""
        if not head_pairs:
            return self.attention_tile
        slice_start, last_window = self.pair_slot_start(1), self.d - self.pair_cols
        return widest_tile(math.gcd(self.head_dim, slice_start, last_window))

    @property
    def q_tiles(self) -> int:
        """The qkv product's first output tiles, those that hold q's columns (the last of them
        also the first k columns): `Schedule.overlap` streams them first."""
        return -(-self.d // self.unit_cols)

    @property
    def table_rows(self) -> int:
        """Rows of the RoPE tables and the qk bias: d, and the kp - head_dim that the last
        head's key window reads past it."""
        return self.d + self.kp - self.head_dim

    @property
    def step_kinds(self) -> tuple[str, ...]:
        """The kind (`STEP_KINDS`) of each step of an iteration, in order: one per product, the
        attention after each qkv. A hand-over (a grid barrier, or tile counters) follows each."""
        kinds = []
        for p in self.phases:
            kind = kind_of(p.name)[0]
            kinds += [kind, "attn"] if kind == "qkv" else [kind]
        return tuple(kinds)

    def step_before(self, p: int) -> str:
        """The kind of step whose output product p reads: the step before it in `step_kinds`
        ("" for the adapter, which reads the state)."""
        steps = self.step_kinds
        products = [i for i, kind in enumerate(steps) if kind != "attn"]
        return steps[products[p] - 1] if p else ""

    @property
    def steps_per_iteration(self) -> int:
        """Steps between hand-overs per iteration: one per product, one attention per layer."""
        return len(self.step_kinds)

    @property
    def buffer_rows(self) -> int:
        """Rows of each `act` buffer: the widest product output, the qkv output with the
        padding around it."""
        return max(2 * SHIFT + self.phases[1].n, max(p.n for p in self.phases))


class Buffers:
    """Indices into `act`: the adapter output a, layer 0's input z0 = a r + e @ Wa[D:], then per
    layer the qkv output (rows shifted by SHIFT), the attention output, the proj output with the
    residual added (h1), the fc output (the gate's and the up half's rows interleaved by 64,
    `fused_step.interleave_halves`) and the mlp output with the residual added (the next
    layer's input z, or after the last layer the state)."""

    A = 0
    Z0 = 1

    @staticmethod
    def of(kind: str, layer: int) -> int:
        return 2 + len(BUFFER_KINDS) * layer + BUFFER_KINDS.index(kind)

    @staticmethod
    def count(layers: int) -> int:
        return 2 + len(BUFFER_KINDS) * layers


class ScalarRows:
    """Rows of the scalar tile: Σ of squares of the iteration's vectors, per batch column."""

    STATE = 0  # Σ z², z the state the adapter takes (iterations after the first)

    @staticmethod
    def z(layer: int) -> int:  # Σ z², z layer j's input before norm_4 of layer j - 1
        return 1 + 4 * layer

    @staticmethod
    def zg(layer: int) -> int:  # Σ (z g4)²
        return 2 + 4 * layer

    @staticmethod
    def h1(layer: int) -> int:  # Σ h1², h1 = x + attention
        return 3 + 4 * layer

    @staticmethod
    def h1g(layer: int) -> int:  # Σ (h1 g2)²
        return 4 + 4 * layer


GAIN_G4_BEFORE, GAIN_G2 = 0, 1  # columns of a layer's gain tile: norm_4 of the layer before, norm_2


MAX_PAIR_SPLITS = 4  # splits of a pair window's cached positions at most (`attention_items`)


def splits_for(heads: int, workers: int) -> int:
    """Blocks of each head's cached positions, one per worker: as many as keep every split on
    its own worker (at least 1)."""
    return max(1, workers // heads)


def attention_items(shape: FusedShape, workers: int, head_pairs: bool) -> tuple[int, int]:
    """(items, splits) of the attention step: every head's cached positions in `splits` of
    one item each (`splits_for`), or with `head_pairs` every pair window's, in at most
    `MAX_PAIR_SPLITS` (the combine takes the other splits' partials into a buffer each)."""
    if head_pairs:
        splits = min(MAX_PAIR_SPLITS, splits_for(shape.pairs, workers))
        return shape.pairs * splits, splits
    splits = splits_for(shape.heads, workers)
    return shape.heads * splits, splits


def unit_ranges(shape: FusedShape, phase: Phase, worker, workers: int, overlap: bool) -> tuple:
    """The ranges (first unit, units) of `phase` that `worker` of `workers` takes, in order:
    its even share of the units (`plan.even_share`), or with `overlap`, in a qkv, its share of
    the tiles that hold q (`FusedShape.q_tiles`), then of the rest. `worker` may be traced."""

    def share(units, offset=0):
        start, end = even_share(units, workers, worker)
        return offset + start, end - start

    units = phase.units(shape.unit_cols)
    if overlap and kind_of(phase.name)[0] == "qkv":
        in_q = shape.q_tiles * phase.k_chunks
        return share(in_q), share(units - in_q, in_q)
    return (share(units),)


def tiles_per_counter(shape: FusedShape, schedule: Schedule, p: int) -> int:
    """Output tiles of product p per counter: 1 for a qkv (the attention's items wait on its
    tiles), else `Schedule.counter_tiles` (another product reads them)."""
    return 1 if kind_of(shape.phases[p].name)[0] == "qkv" else schedule.counter_tiles


def counter_span(shape: FusedShape, schedule: Schedule, p: int) -> int:
    """Rows of the output before product p that one of its counters counts: a tile of the
    attention output before a proj, else `tiles_per_counter` tiles of product p - 1."""
    if kind_of(shape.phases[p].name)[0] == "proj":
        return shape.unit_cols
    return shape.unit_cols * tiles_per_counter(shape, schedule, p - 1)


def starts_counter(kc, rows: int, span: int):
    """Whether input chunk kc of `rows` rows starts the `span` rows of a counter: the unit
    that reads it waits on that counter. kc may be traced."""
    return (kc * rows) % span == 0


def waits_on_counter(i, first_range: int, kc, rows: int, span: int):
    """Whether a worker's i-th unit of a product, whose input chunk is kc, waits on a counter
    of its input: its first unit, the first of its second range (`first_range` units in its
    first), and a unit whose chunk starts a counter's rows (`starts_counter`). Python ints or
    traced."""
    return (i == 0) | (i == first_range) | starts_counter(kc, rows, span)


def tile_signals(phase: Phase, cols: int, workers: int, residual_chunks: int, t, split_at=0):
    """The signals that complete output tile t of a product (`Schedule.handover`): one from
    every worker whose units cover part of the tile (worker w owns units [u w // W,
    u (w + 1) // W) of u, so unit x is worker ((x + 1) W - 1) // u's), one for each of the
    residual's 64-row chunks (`residual_chunks` of them, 0 where the product adds none) that
    falls in it. `split_at` > 0: the units are shared out as two ranges, [0, split_at) and the
    rest, a tile in one of them (`unit_ranges` with overlap). t may be traced."""
    units, kch, per_tile = phase.units(cols), phase.k_chunks, cols // UNIT

    def covering(offset, n):  # the workers whose share of units [offset, offset + n) meet t
        def owner(x):
            return ((x - offset + 1) * workers - 1) // n

        return owner((t + 1) * kch - 1) - owner(t * kch) + 1

    signals = covering(0, units)
    if split_at:
        first = covering(0, split_at)
        signals = jnp.where(t * kch < split_at, first, covering(split_at, units - split_at))
    if residual_chunks:
        signals = signals + jnp.clip(residual_chunks - t * per_tile, 0, per_tile)
    return signals


def counter_signals(
    phase: Phase, cols: int, workers: int, residual_chunks: int, g, group: int, split_at=0
):
    """The signals that complete counter g of a product whose counters count `group` output
    tiles each (`Schedule.counter_tiles`): those of its tiles [g group, (g + 1) group), fewer in
    the last counter (`tile_signals` for the rest of the arguments). g may be traced."""
    tiles = phase.tiles(cols)
    total = 0
    for i in range(group):
        t = g * group + i
        total = total + jnp.where(
            t < tiles, tile_signals(phase, cols, workers, residual_chunks, t, split_at), 0
        )
    return total


def attention_tile_heads(shape: FusedShape, cols: int, t):
    """The heads whose value windows (`FusedShape.head_window`, kp rows each) meet rows
    [cols t, cols (t + 1)) of the attention output: the adds that complete that tile. The
    windows start at c0(h) = min(h head_dim, d - kp), which never decreases with h, so the
    heads with c0 < x are the first `before(x)`. t may be traced."""
    last = shape.d - shape.kp

    def before(x):
        first_heads = jnp.clip((x + shape.head_dim - 1) // shape.head_dim, 0, shape.heads)
        return jnp.where(x > last, shape.heads, first_heads)

    return before(cols * (t + 1)) - before(cols * t - shape.kp + 1)


__all__ = ["BLOCK", "N_PAD", "SHIFT", "UNIT", "Buffers", "FusedShape", "ScalarRows"]
