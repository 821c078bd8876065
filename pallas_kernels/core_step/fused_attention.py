"""The attention step of the fused Core kernel (`fused.py`), between a layer's qkv and proj.

Each (head, block of its cached positions) is one worker's item; the worker reads the head's q,
k, v rows from the complete qkv output, each a window of kp rows: q and k that of the cached key
blocks (`FusedShape.key_window`: the head's own columns where they are whole tiles, as
huginn-0125's 96 are), v that of the cached value blocks (`FusedShape.head_window`):
- scale by the layer input's two norms (rx r1, from the scalar tile), RoPE by rows shifted by
  one (x cos + x[r + 1] (-sin) + x[r - 1] sin, the tables per column), the qk bias's RoPE added
  after the scale (RoPE is linear), q times 1 / sqrt(head_dim);
- scores and weighted values by wgmma over blocks of 64 or 128 cached positions (< pos;
  `Schedule.kv_block`), an online softmax per sequence of the batch, in one pass over the
  item's (sequence, block) pairs with `kv_stages` copies in flight (q and the weights rounded
  to bf16 for the wgmma);
- the head's first split adds the new position (k, v rounded to bf16, as the cache holds them)
  and, once the others' flags count their partials, combines them and adds the head's rows into
  the attention output; it also writes the new k and v rows for the caller's cache write.

With `Schedule.head_pairs`, an item is a split of two neighbouring heads' window
(`FusedShape.pair_window`): one RoPE over the window, each block's step once per head slot, and
each slot's combine on a split of its own (`_two_head_item`). The blocks, the splits' partials
and their merge are `fused_blocks.py`.

With `Schedule.overlap`, a second warpgroup per worker takes its item's q as soon as every
worker has put out its units of q's tiles, runs the item's blocks while the first warpgroup
streams the qkv's k and v columns, and puts its partials out before the barrier after the qkv
(`blocks_ahead`); after it, the first split merges them all with the new position (no flags:
the barrier orders them). With `Schedule.dataflow` no barrier follows the qkv or the
attention: an item waits for its head's qkv tiles and norms, the first split for the others'
flags, and proj's units for the attention output's tiles (`fused_counters.py`).

The windows and tables, the blocks, and the combine each take a scope of shared memory
(`fused_fit.scratch_types`) that the products' scopes reuse.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_blocks import (
    add_head_rows,
    item_window,
    merge,
    merge_others,
    own_blocks,
    partials_out,
)
from pallas_kernels.core_step.fused_plan import N_PAD, SHIFT, Buffers, ScalarRows
from pallas_kernels.core_step.tiles import WGMMA, bcast_rows, round_bf16

ROW_BUFFERS = ("krow", "vrow")  # the combine's buffers of the new k and v rows, transposed


def attention_step(k, it, j) -> None:
    """Layer j's attention at iteration `it`; `k`: the kernel's `fused.KernelContext`. With
    `k.overlap`, the worker's first item's blocks ran during the qkv (`blocks_ahead`)."""

    run = _two_head_item if k.head_pairs else _head_item

    @pl.loop(0, -(-k.items // k.workers))
    def _item(rr):
        item = k.worker + rr * k.workers  # with overlap, one item per worker at most
        pl.when(item < k.items)(lambda: run(k, it, j, item))


def _head_rows(rows, delta, head_dim):
    """The head's rows of a window that starts `delta` columns before it, `rows` the window's
    row index ([kp, 8] iota): a mask."""
    return jnp.logical_and(rows >= delta, rows < delta + head_dim)


def _masks(k, h, starts):
    """(key window's, value window's) head rows of head h: [kp, 8] masks."""
    kp, hd = k.shape.kp, k.shape.head_dim
    rows = plgpu.broadcasted_iota(jnp.int32, (kp, N_PAD), 0, layout=WGMMA)
    ck, c0 = starts
    return _head_rows(rows, h * hd - ck, hd), _head_rows(rows, h * hd - c0, hd)


def _head_item(k, it, j, item) -> None:
    """One item. With `k.overlap` its blocks ran during the qkv and every split's partials are
    out, so only a head's first split has work left."""
    h, split, starts = item_window(k, item)
    masks = _masks(k, h, starts)

    def run():
        if k.dataflow:  # no barrier after the qkv: the head's tiles and norms
            with jax.named_scope("wait_head"):
                k.counters.wait_head(it, j, starts)
        with jax.named_scope("rope"):
            q, k_new, v_new = k.scope("rope", lambda s: _rope(k, it, j, starts, masks, s))
        parts = None
        if not k.overlap:
            with jax.named_scope("blocks"):
                blocks = k.scope("blocks", lambda s: own_blocks(k, it, j, q, starts, split, s))
                parts = blocks[0]
        of, new = (h, split, item), (q, k_new, v_new)
        with jax.named_scope("combine"):
            k.scope("combine", lambda s: _combine(k, it, j, of, starts[1], masks[1], new, parts, s))

    if k.overlap:
        pl.when(split == 0)(run)
    else:
        run()


def _two_head_item(k, it, j, item) -> None:
    """One item of two-head items (`Schedule.head_pairs`): a split of a pair window's cached
    blocks (`FusedShape.pair_window`) for both its head slots. Every split puts out its
    partials of the slots whose heads it does not combine, then combines the others: slot e
    is combined by split e mod splits. The first slot of the last window of an odd number of
    heads is the head before it, which the window before combines: left out here."""
    shape = k.shape
    pair, split, starts = item_window(k, item)
    first_head = starts[0] // shape.head_dim
    heads = (first_head, first_head + 1)
    own = (first_head >= 2 * pair, True)
    with jax.named_scope("rope"):
        q, k_pair, news = k.scope("rope", lambda s: _pair_rope(k, it, j, starts[0], s))
    with jax.named_scope("blocks"):
        parts = k.scope("blocks", lambda s: own_blocks(k, it, j, q, starts, split, s))
    combiners = tuple(e % k.splits for e in range(2))

    def combine(s):
        s = {**k.s, **s}
        for e in range(2 if k.splits > 1 else 0):
            puts = jnp.logical_and(own[e], split != combiners[e])
            index = heads[e] * k.splits + split
            pl.when(puts)(
                lambda e=e, index=index: partials_out(k, index, parts[e], s["pout"], heads[e])
            )
        for e in range(2):
            combines = jnp.logical_and(own[e], split == combiners[e])
            args = (heads[e], starts[0], k_pair, news[e], parts[e], combiners[e])
            pl.when(combines)(lambda e=e, args=args: _combine_slot(k, it, j, e, *args, s))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the scope's bytes are reused next

    with jax.named_scope("combine"):
        k.scope("combine", combine)


def _pair_rope(k, it, j, first, s):
    """(q, k rows [pair_cols, 8], per head slot (its new position's score [8], its value
    slice's new v rows [kp, 8])) of the pair window from column `first`, scaled and RoPE'd as
    `_rope`'s."""
    shape = k.shape
    hd, kp, rows = shape.head_dim, shape.kp, shape.pair_cols
    scale, scaled, window, tab = _rope_inputs(k, it, j, (first, first), rows, s)
    q = (scaled * _roped(window, tab, 0) + tab(3)) * (1.0 / math.sqrt(hd))
    k_new = round_bf16(scaled * _roped(window, tab, 1) + tab(4))
    row = plgpu.broadcasted_iota(jnp.int32, (rows, N_PAD), 0, layout=WGMMA)
    news = []
    for e in range(2):
        in_slot = jnp.logical_and(row >= e * hd, row < (e + 1) * hd)
        score = jnp.sum(jnp.where(in_slot, q * k_new, 0.0), axis=0)
        v_new = round_bf16(bcast_rows(scale, kp) * window(2, shape.pair_slot_start(e), kp))
        news.append((score, v_new))
    return q, k_new, news


def _combine_slot(k, it, j, e, h, first, k_pair, new, parts, combiner, s) -> None:
    """Head slot e's combine (head h, its pair window from column `first`): its new k rows
    (the head's own columns) and v rows (its value slice, `FusedShape.value_window`) out, its
    blocks' partials merged with the new position and the other splits', its rows added into
    the attention output."""
    shape = k.shape
    hd, kp = shape.head_dim, shape.kp
    score, v_new = new
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    s["krow"].T[...] = k_pair.astype(jnp.bfloat16)
    s["vrow"].T[...] = v_new.astype(jnp.bfloat16)
    plgpu.commit_smem()
    k_dst = k.kv_new.at[it, j, 0, h, :, pl.ds(0, hd)]
    plgpu.copy_smem_to_gmem(s["krow"].at[:, pl.ds(e * hd, hd)], k_dst)
    plgpu.copy_smem_to_gmem(s["vrow"], k.kv_new.at[it, j, 1, h])
    s_new = bcast_rows(score, kp)
    merged = merge(*parts, s_new, jnp.ones_like(s_new), v_new)
    others = [(combiner + r) % k.splits for r in range(1, k.splits)]
    merged = merge_others(k, it, j, h, merged, others, k.splits > 1, s)
    c0 = first + shape.pair_slot_start(e)
    rows = plgpu.broadcasted_iota(jnp.int32, (kp, N_PAD), 0, layout=WGMMA)
    add_head_rows(k, it, j, merged, c0, _head_rows(rows, h * hd - c0, hd), s)


def blocks_ahead(k, it, j, item) -> None:
    """Item `item`'s q and cached blocks, run by the worker's second warpgroup (`k` its
    context, `Schedule.overlap`) while the first streams the qkv's k and v columns: once every
    worker has put out its units of q's tiles, q is RoPE'd and the blocks taken; the partials
    go out, then the first warpgroup is told (`parts_ready`). Profiled (in the second
    warpgroup's trace) as ahead{j}, holding wait_q, rope, blocks and partials_out."""
    h, split, starts = item_window(k, item)
    target = k.workers * (it * k.shape.layers + j + 1)
    with jax.named_scope(f"ahead{j}"):
        with jax.named_scope("wait_q"):
            plgpu.semaphore_wait(k.q_done, target, decrement=False, memory_scope="gpu")
        with jax.named_scope("rope"):
            q = k.scope("rope", lambda s: _rope(k, it, j, starts, _masks(k, h, starts), s)[0])
        with jax.named_scope("blocks"):
            parts = k.scope("blocks", lambda s: own_blocks(k, it, j, q, starts, split, s))
        with jax.named_scope("partials_out"):
            partials_out(k, item, parts[0], k.s["pin"])
            if k.dataflow and k.splits > 1:  # no barrier after the qkv: the first split waits

                @pl.when(split > 0)
                def _signal():
                    plgpu.semaphore_signal(k.flags.at[h], 1, memory_scope="gpu")

    plgpu.barrier_arrive(k.parts_ready)


def _scale(k, it, j):
    """[8]: the layer input's two norms (rx r1) from the scalar tile in shared memory."""
    if j == 0:
        rx = plgpu.layout_cast(jnp.ones((N_PAD,), jnp.float32), WGMMA.reduce(0))
    else:
        rx = k.inv_rms(k.scalar(it, ScalarRows.z(j)))
    r1 = k.inv_rms(k.scalar(it, ScalarRows.zg(j)) * rx * rx)
    return rx * r1


def _rope_inputs(k, it, j, starts, rows, s):
    """Layer j's q, k and v windows of `rows` rows (q and k from column ck, v from c0 of
    `starts`, with SHIFT rows either side), the RoPE tables and qk bias of the key window's
    rows and the scalar tile, copied at once, then waited for: (the norms' scale [8], it
    broadcast [rows, 8], window(w, shift, n=rows), tab(t)), the loads of window w's n rows
    shifted by `shift` and of table t (cos, -sin, sin, q's and k's bias)."""
    d = k.shape.d
    ck, c0 = starts
    win = rows + 2 * SHIFT
    qkv = Buffers.of("qkv", j)
    k.load_scalars(wait=False)
    for w, start in enumerate((ck, d + ck, 2 * d + c0)):
        src = k.acts(it).at[qkv, pl.ds(start, win), :]
        plgpu.copy_gmem_to_smem(src, s["win"].at[w], s["abar"])
    tabs, biases = s["tab"].at[pl.ds(0, 3)], s["tab"].at[pl.ds(3, 2)]
    plgpu.copy_gmem_to_smem(k.tables.at[:, pl.ds(ck, rows), :], tabs, s["abar"])
    plgpu.copy_gmem_to_smem(k.rope_bias.at[j, :, pl.ds(ck, rows), :], biases, s["abar"])
    plgpu.barrier_wait(k.s["scbar"])
    scale = _scale(k, it, j)
    scaled = bcast_rows(scale, rows)
    plgpu.barrier_wait(s["abar"])

    def window(w, shift, n=rows):
        return plgpu.load(s["win"].at[w, pl.ds(SHIFT + shift, n)], layout=WGMMA)

    def tab(t):
        return plgpu.load(s["tab"].at[t], layout=WGMMA)

    return scale, scaled, window, tab


def _roped(window, tab, w):
    """Window w RoPE'd by rows shifted by one: x cos + x[r + 1] (-sin) + x[r - 1] sin."""
    return window(w, 0) * tab(0) + window(w, 1) * tab(1) + window(w, -1) * tab(2)


def _rope(k, it, j, starts, masks, s):
    """(q, k_new, v_new) [kp, 8], RoPE'd and scaled: q and k_new of the key window (first
    column ck), v_new of the value window (c0); `starts` (ck, c0), `masks` their head rows."""
    shape = k.shape
    kvalid, valid = masks
    _, scale, window, tab = _rope_inputs(k, it, j, starts, shape.kp, s)
    inv_sqrt = 1.0 / math.sqrt(shape.head_dim)
    q = jnp.where(kvalid, (scale * _roped(window, tab, 0) + tab(3)) * inv_sqrt, 0.0)
    k_new = jnp.where(kvalid, round_bf16(scale * _roped(window, tab, 1) + tab(4)), 0.0)
    v_new = jnp.where(valid, round_bf16(scale * window(2, 0)), 0.0)
    return q, k_new, v_new


def _combine(k, it, j, of, c0, valid, new, parts, s) -> None:
    """The new k and v rows out (a head's first split), then the item's partials out (a later
    split) or the head's combine (the first split): its splits' partials and the new position
    merged, the head's rows added into the attention output. `of`: (head, split, item); `c0`:
    the first column of the value window, whose rows the output holds; `new`: (q, k_new,
    v_new); `parts`: the item's (max, sum, weighted values) from its blocks, or None where
    every split's are out already (`blocks_ahead`); `s`: the combine's scope."""
    s = {**k.s, **s}
    kp = k.shape.kp
    h, split, item = of
    q, k_new, v_new = new

    @pl.when(split == 0)
    def _store_new_rows():
        for w, value in enumerate((k_new, v_new)):
            s[ROW_BUFFERS[w]].T[...] = value.astype(jnp.bfloat16)
        plgpu.commit_smem()
        for w in range(2):
            plgpu.copy_smem_to_gmem(s[ROW_BUFFERS[w]], k.kv_new.at[it, j, w, h])

    def first_split():
        s_new = bcast_rows(jnp.sum(q * k_new, axis=0), kp)
        merged = (s_new, jnp.ones_like(s_new), v_new)
        if parts is not None:
            merged = merge(*parts, *merged)
        others = range(0 if parts is None else 1, k.splits)
        wait_flags = k.splits > 1 and (parts is not None or k.dataflow)
        merged = merge_others(k, it, j, h, merged, others, wait_flags, s)
        add_head_rows(k, it, j, merged, c0, valid, s)

    if k.splits > 1 and parts is not None:
        pl.when(split > 0)(lambda: partials_out(k, item, parts, s["pout"], flag=h))
    pl.when(split == 0)(first_split)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the scope's bytes are reused next
