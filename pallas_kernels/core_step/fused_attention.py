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
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_plan import (
    N_PAD,
    SCALAR_ROWS,
    SHIFT,
    Buffers,
    ScalarRows,
)
from pallas_kernels.core_step.tiles import WGMMA, bcast_rows, in_row, round_bf16, row_of

MASKED = -1e30  # the model's masked score: finite, so exp(MASKED - m) is 0, never NaN


def attention_step(k, it, j) -> None:
    """Layer j's attention at iteration `it`; `k`: the kernel's `fused.KernelContext`. With
    `k.overlap`, the worker's first item's blocks ran during the qkv (`blocks_ahead`)."""

    @pl.loop(0, -(-k.items // k.workers))
    def _item(rr):
        item = k.worker + rr * k.workers  # with overlap, one item per worker at most
        pl.when(item < k.items)(lambda: _head_item(k, it, j, item))


def _masks(k, h, starts):
    """(key window's, value window's) head rows of head h: [kp, 8] masks."""
    kp, hd = k.shape.kp, k.shape.head_dim
    rows = plgpu.broadcasted_iota(jnp.int32, (kp, N_PAD), 0, layout=WGMMA)

    def head_rows(delta):  # the head's rows of a window that starts delta columns before it
        return jnp.logical_and(rows >= delta, rows < delta + hd)

    ck, c0 = starts
    return head_rows(h * hd - ck), head_rows(h * hd - c0)


def _head_item(k, it, j, item) -> None:
    """One item. With `k.overlap` its blocks ran during the qkv and every split's partials are
    out, so only a head's first split has work left."""
    h, split, starts = _window(k, item)
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
                parts = k.scope("blocks", lambda s: _own_blocks(k, it, j, q, starts, split, s))
        of, new = (h, split, item), (q, k_new, v_new)
        with jax.named_scope("combine"):
            k.scope("combine", lambda s: _combine(k, it, j, of, starts[1], masks[1], new, parts, s))

    if k.overlap:
        pl.when(split == 0)(run)
    else:
        run()


def blocks_ahead(k, it, j, item) -> None:
    """Item `item`'s q and cached blocks, run by the worker's second warpgroup (`k` its
    context, `Schedule.overlap`) while the first streams the qkv's k and v columns: once every
    worker has put out its units of q's tiles, q is RoPE'd and the blocks taken; the partials
    go out, then the first warpgroup is told (`parts_ready`). Profiled (in the second
    warpgroup's trace) as ahead{j}, holding wait_q, rope, blocks and partials_out."""
    h, split, starts = _window(k, item)
    target = k.workers * (it * k.shape.layers + j + 1)
    with jax.named_scope(f"ahead{j}"):
        with jax.named_scope("wait_q"):
            plgpu.semaphore_wait(k.q_done, target, decrement=False, memory_scope="gpu")
        with jax.named_scope("rope"):
            q = k.scope("rope", lambda s: _rope(k, it, j, starts, _masks(k, h, starts), s)[0])
        with jax.named_scope("blocks"):
            parts = k.scope("blocks", lambda s: _own_blocks(k, it, j, q, starts, split, s))
        with jax.named_scope("partials_out"):
            _partials_out(k, item, parts, k.s["pin"])
            if k.dataflow and k.splits > 1:  # no barrier after the qkv: the first split waits

                @pl.when(split > 0)
                def _signal():
                    plgpu.semaphore_signal(k.flags.at[h], 1, memory_scope="gpu")

    plgpu.barrier_arrive(k.parts_ready)


def _scale(k, it, j):
    """[kp, 8]: the layer input's two norms (rx r1) from the scalar tile in shared memory."""
    if j == 0:
        rx = plgpu.layout_cast(jnp.ones((N_PAD,), jnp.float32), WGMMA.reduce(0))
    else:
        rx = k.inv_rms(k.scalar(it, ScalarRows.z(j)))
    r1 = k.inv_rms(k.scalar(it, ScalarRows.zg(j)) * rx * rx)
    return bcast_rows(rx * r1, k.shape.kp)


def _rope(k, it, j, starts, masks, s):
    """(q, k_new, v_new) [kp, 8], RoPE'd and scaled: q and k_new of the key window (first
    column ck), v_new of the value window (c0); `starts` (ck, c0), `masks` their head rows. The
    scalar tile, the windows and the tables are copied at once, then waited for."""
    shape = k.shape
    kp, hd, d = shape.kp, shape.head_dim, shape.d
    (ck, c0), (kvalid, valid) = starts, masks
    win = kp + 2 * SHIFT
    qkv = Buffers.of("qkv", j)
    k.load_scalars(wait=False)
    for w, start in enumerate((ck, d + ck, 2 * d + c0)):
        src = k.acts(it).at[qkv, pl.ds(start, win), :]
        plgpu.copy_gmem_to_smem(src, s["win"].at[w], s["abar"])
    tabs, biases = s["tab"].at[pl.ds(0, 3)], s["tab"].at[pl.ds(3, 2)]
    plgpu.copy_gmem_to_smem(k.tables.at[:, pl.ds(ck, kp), :], tabs, s["abar"])
    plgpu.copy_gmem_to_smem(k.rope_bias.at[j, :, pl.ds(ck, kp), :], biases, s["abar"])
    plgpu.barrier_wait(k.s["scbar"])
    scale = _scale(k, it, j)
    plgpu.barrier_wait(s["abar"])

    def window(w, shift):
        return plgpu.load(s["win"].at[w, pl.ds(SHIFT + shift, kp)], layout=WGMMA)

    def tab(t):
        return plgpu.load(s["tab"].at[t], layout=WGMMA)

    def rope(w):
        return window(w, 0) * tab(0) + window(w, 1) * tab(1) + window(w, -1) * tab(2)

    q = jnp.where(kvalid, (scale * rope(0) + tab(3)) * (1.0 / math.sqrt(hd)), 0.0)
    k_new = jnp.where(kvalid, round_bf16(scale * rope(1) + tab(4)), 0.0)
    v_new = jnp.where(valid, round_bf16(scale * window(2, 0)), 0.0)
    return q, k_new, v_new


def _partials_out(k, item, parts, buf, signal: bool = False) -> None:
    """An item's (max, sum, weighted values) into `k.parts` through `buf` ([kp + 64, 8] of
    shared memory); `signal`: then counts it on its head's flag."""
    kp = k.shape.kp
    m_all, l_all, acc_all = parts
    ml = in_row(jnp.max(m_all, axis=0), 0) + in_row(jnp.max(l_all, axis=0), 1)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    buf.at[pl.ds(0, kp)][...] = acc_all
    buf.at[pl.ds(kp, SCALAR_ROWS)][...] = ml
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf.at[pl.ds(0, kp + SCALAR_ROWS)], k.parts.at[item])
    plgpu.wait_smem_to_gmem(0)
    if signal:
        plgpu.semaphore_signal(k.flags.at[item // k.splits], 1, memory_scope="gpu")


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
            s["pout"].at[pl.ds(w * kp, kp)][...] = value
        plgpu.commit_smem()
        for w in range(2):
            plgpu.copy_smem_to_gmem(s["pout"].at[pl.ds(w * kp, kp)], k.kv_new.at[it, j, w, h])

    def merge(m_all, l_all, acc_all, m_o, l_o, acc_o):
        m_new = jnp.maximum(m_all, m_o)
        wa, wo = jnp.exp(m_all - m_new), jnp.exp(m_o - m_new)
        return m_new, l_all * wa + l_o * wo, acc_all * wa + acc_o * wo

    def first_split():
        s_new = bcast_rows(jnp.sum(q * k_new, axis=0), kp)
        merged = (s_new, jnp.ones_like(s_new), v_new)
        if parts is not None:
            merged = merge(*parts, *merged)
        if k.splits > 1 and (parts is not None or k.dataflow):
            target = jnp.asarray((it * k.shape.layers + j + 1) * (k.splits - 1), jnp.int32)
            plgpu.semaphore_wait(k.flags.at[h], target, decrement=False, memory_scope="gpu")
        for other in range(0 if parts is None else 1, k.splits):
            plgpu.copy_gmem_to_smem(k.parts.at[h * k.splits + other], s["pin"], s["pbar"])
            plgpu.barrier_wait(s["pbar"])
            acc_o = plgpu.load(s["pin"].at[pl.ds(0, kp)], layout=WGMMA)
            ml = plgpu.load(s["pin"].at[pl.ds(kp, SCALAR_ROWS)], layout=WGMMA)
            merged = merge(*merged, row_of(ml, 0, kp), row_of(ml, 1, kp), acc_o)
        _, l_fin, acc_fin = merged
        out = jnp.where(valid, acc_fin / l_fin, 0.0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        s["pout"].at[pl.ds(0, kp)][...] = out
        plgpu.commit_smem()
        dst = k.acts(it).at[Buffers.of("att", j), pl.ds(c0, kp), :]
        k.add_into(s["pout"].at[pl.ds(0, kp)], dst, kp)
        if k.dataflow:  # proj's units wait for the tiles the head's rows went into
            plgpu.wait_smem_to_gmem(0)
            k.counters.signal_head(j, c0)

    if k.splits > 1 and parts is not None:
        pl.when(split > 0)(lambda: _partials_out(k, item, parts, s["pout"], signal=True))
    pl.when(split == 0)(first_split)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the scope's bytes are reused next


class _Pairs:
    """The (sequence, block) pairs of split `split` of a head at layer j, iteration it: its
    blocks [lo, hi) of the cached positions (< pos) for every sequence of the batch, `total`
    of them; pair f is block lo + f mod own of sequence f // own, in cache slot `slot`."""

    def __init__(self, k, it, j, split):
        self.k = k
        self.block = k.kv_block
        nb = (k.pos + self.block - 1) // self.block
        self.lo, self.hi = nb * split // k.splits, nb * (split + 1) // k.splits
        self.own = jnp.maximum(self.hi - self.lo, 1)
        self.total = k.shape.batch * (self.hi - self.lo)
        self.slot = k.meta[1 + it * k.shape.layers + j]

    def pair(self, f):
        """(sequence, block) of pair f."""
        b = f // self.own
        return b, self.lo + f - b * self.own

    def source(self, cache, f, c0, cols):
        """Pair f's window of `cache`: `cols` columns from c0 of its block's cached positions."""
        b, blk = self.pair(f)
        return cache.at[self.slot, b, pl.ds(blk * self.block, self.block), pl.ds(c0, cols)]

    def stream(self, starts, s):
        """Issues the copies of the first kv_stages - 1 pairs' k and v blocks (`sources`, from
        the windows' `starts`), each into stage f mod kv_stages of the blocks' scope `s`;
        returns take(f), which waits for pair f's stage, issues the copy kv_stages - 1 pairs
        ahead (into the stage the step before read, whose wgmmas are done) and returns the
        stage."""
        stages = self.k.kv_stages

        def copy_block(f):
            st = lax.rem(f, stages)
            blocks = (s["kblk"], s["vblk"])
            for src, buf in zip(self.sources(f, *starts), blocks, strict=True):
                plgpu.copy_gmem_to_smem(src, buf.at[st], s["kvbar"].at[st])

        for f in range(stages - 1):
            pl.when(f < self.total)(lambda f=f: copy_block(f))

        def take(f):
            st = lax.rem(f, stages)
            plgpu.barrier_wait(s["kvbar"].at[st])
            ahead = f + stages - 1
            pl.when(ahead < self.total)(lambda: copy_block(ahead))
            return st

        return take

    def sources(self, f, ck, c0):
        """Pair f's key block (`key_cols` from ck) and value block (kp columns from c0)."""
        k = self.k
        return (
            self.source(k.k_cache, f, ck, k.shape.key_cols),
            self.source(k.v_cache, f, c0, k.shape.kp),
        )


def _window(k, item):
    """(head, split, (ck, c0)) of an item: ck and c0 the first columns of the head's key window
    (`FusedShape.key_window`) and value window (`head_window`)."""
    h = item // k.splits
    starts = k.shape.key_window(h, jnp.minimum)[0], k.shape.head_window(h, jnp.minimum)[0]
    return h, lax.rem(item, k.splits), starts


def prefetch_blocks(k, it, j, count: int) -> None:
    """Layer j's attention at iteration `it`: the first `count` (sequence, block) pairs (k and
    v) of each of the worker's items into L2, ahead of their copies."""

    def prefetch(item):
        _, split, starts = _window(k, item)
        pairs = _Pairs(k, it, j, split)
        for f in range(count):
            for src in pairs.sources(f, *starts):
                plgpu.async_prefetch(src, predicate=f < pairs.total)

    for rr in range(-(-k.items // k.workers)):
        item = k.worker + rr * k.workers
        pl.when(item < k.items)(lambda item=item: prefetch(item))


def _own_blocks(k, it, j, q, starts, split, s):
    """This split's (sequence, block) pairs (`_Pairs`), one pass over them with `kv_stages`
    copies in flight, an online softmax per sequence: (max, sum, weighted values), each [kp, 8]
    (column b the sequence b's; the [8] ones broadcast over the rows). The scores are those of
    every q column against sequence b's keys, of which column b is kept (q rounded to bf16 for
    the wgmma). The softmax's sums are kept per row of a block and summed over the rows once,
    after the pass: a block's step reduces across its rows (over the warps) for the max only.
    `starts`: the first columns (ck, c0) of the key and value windows; q is in the key
    window's rows, whose first `key_cols` the key blocks hold."""
    kp, block, f32 = k.shape.kp, k.kv_block, jnp.float32
    pairs = _Pairs(k, it, j, split)
    lo, hi, total = pairs.lo, pairs.hi, pairs.total
    colidx = plgpu.broadcasted_iota(jnp.int32, (kp, N_PAD), 1, layout=WGMMA)
    block_cols = plgpu.broadcasted_iota(jnp.int32, (block, N_PAD), 1, layout=WGMMA)
    rows = plgpu.broadcasted_iota(jnp.int32, (block, N_PAD), 0, layout=WGMMA)
    s["btq"].T[...] = q.astype(jnp.bfloat16)
    plgpu.commit_smem()
    q_keys = s["btq"].at[:, pl.ds(0, k.shape.key_cols)].T

    take = pairs.stream(starts, s)

    def step(f, carry):
        m, ll, acc, m_all, l_all, acc_all = carry  # ll, l_all: [block, 8] sums per row
        b, blk = pairs.pair(f)
        st = take(f)
        keep = (blk != lo).astype(f32)  # 0 at a sequence's first block: start afresh
        m, ll, acc = m * keep + MASKED * (1.0 - keep), ll * keep, acc * keep

        def scores_of(acc_ref):
            plgpu.wgmma(acc_ref, s["kblk"].at[st], q_keys)
            return acc_ref[...]

        sc = pl.run_scoped(scores_of, plgpu.ACC((block, N_PAD), f32))
        sc = jnp.where(rows + blk * block < k.pos, sc, MASKED)
        m_new = jnp.maximum(m, jnp.max(sc, axis=0))
        alpha = jnp.exp(m - m_new)
        pr = jnp.exp(sc - bcast_rows(m_new, block))
        ll = ll * bcast_rows(alpha, block) + pr
        s["pb"].T[...] = pr.astype(jnp.bfloat16)
        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, s["vblk"].at[st].T, s["pb"].T)
            return acc_ref[...]

        acc = acc * bcast_rows(alpha, kp) + pl.run_scoped(pv, plgpu.ACC((kp, N_PAD), f32))
        last = jnp.where(blk == hi - 1, b, -1)  # column b at its last block
        m_all = jnp.where(colidx == last, bcast_rows(m_new, kp), m_all)
        l_all = jnp.where(block_cols == last, ll, l_all)
        acc_all = jnp.where(colidx == last, acc, acc_all)
        return m_new, ll, acc, m_all, l_all, acc_all

    def tile(rows, value):
        return plgpu.layout_cast(jnp.full((rows, N_PAD), value, f32), WGMMA)

    m0 = plgpu.layout_cast(jnp.full((N_PAD,), MASKED, f32), WGMMA.reduce(0))
    init = (m0, tile(block, 0.0), tile(kp, 0.0), tile(kp, MASKED), tile(block, 0.0), tile(kp, 0.0))
    _, _, _, m_all, l_rows, acc_all = lax.fori_loop(0, total, step, init)
    return m_all, bcast_rows(jnp.sum(l_rows, axis=0), kp), acc_all
