"""The cached blocks of the fused Core kernel's attention step (`fused_attention.py`): an item's
windows, its (sequence, block) pairs of cached positions copied with `Schedule.kv_stages` key
and `Schedule.stages_of_values` value blocks in flight (and prefetched into L2,
`Schedule.l2_blocks`), the online softmax over them per head slot, and the splits' partials:
put out, merged with the others', and the merged rows added into the attention output.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_plan import N_PAD, SCALAR_ROWS, Buffers
from pallas_kernels.core_step.tiles import WGMMA, bcast_rows, in_row, row_of

MASKED = -1e30  # the model's masked score: finite, so exp(MASKED - m) is 0, never NaN


def item_window(k, item):
    """(head, split, (ck, c0)) of an item: ck and c0 the first columns of the head's key window
    (`FusedShape.key_window`) and value window (`head_window`); with two-head items (pair,
    split, (c0, c0)), c0 the first column of the pair's window (`FusedShape.pair_window`)."""
    group = item // k.splits
    if k.head_pairs:
        starts = (k.shape.pair_window(group, jnp.minimum),) * 2
    else:
        shape = k.shape
        starts = shape.key_window(group, jnp.minimum)[0], shape.head_window(group, jnp.minimum)[0]
    return group, lax.rem(item, k.splits), starts


class _SequenceBlocks:
    """The (sequence, block) pairs of split `split` of an item at layer j, iteration it: its
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
        """Issues the copies of the first pairs' key blocks (`kv_stages` - 1 of them) and value
        blocks (`value_stages` - 1; `sources`, from the windows' `starts`), pair f's into stage
        f mod stages of the blocks' scope `s`, each kind on barriers of its own; returns
        (keys(f), values(f)): keys waits for pair f's key block, issues both kinds' copies
        their stages - 1 pairs ahead (into the stages the step before read, whose wgmmas are
        done) and returns the key block's stage; values waits for pair f's value block and
        returns its stage."""
        kinds = (
            (self.k.kv_stages, s["kblk"], s["kbar"]),
            (self.k.value_stages, s["vblk"], s["vbar"]),
        )

        def copy_block(f, kind):
            stages, blocks, bars = kinds[kind]
            st = lax.rem(f, stages)
            src = self.sources(f, *starts)[kind]
            plgpu.copy_gmem_to_smem(src, blocks.at[st], bars.at[st])

        for kind, (stages, _, _) in enumerate(kinds):
            for f in range(stages - 1):
                pl.when(f < self.total)(lambda f=f, kind=kind: copy_block(f, kind))

        def wait(f, kind):
            stages, _, bars = kinds[kind]
            st = lax.rem(f, stages)
            plgpu.barrier_wait(bars.at[st])
            return st

        def keys(f):
            st = wait(f, 0)
            for kind, (stages, _, _) in enumerate(kinds):
                ahead = f + stages - 1
                pl.when(ahead < self.total)(lambda ahead=ahead, kind=kind: copy_block(ahead, kind))
            return st

        return keys, lambda f: wait(f, 1)

    def sources(self, f, ck, c0):
        """Pair f's key block (`key_cols` from ck) and value block (kp columns from c0); with
        two-head items both a pair window's (`pair_cols` from ck = c0)."""
        shape = self.k.shape
        cols = (shape.pair_cols,) * 2 if self.k.head_pairs else (shape.key_cols, shape.kp)
        return (
            self.source(self.k.k_cache, f, ck, cols[0]),
            self.source(self.k.v_cache, f, c0, cols[1]),
        )


def prefetch_blocks(k, it, j, count: int) -> None:
    """Layer j's attention at iteration `it`: the first `count` (sequence, block) pairs (k and
    v) of each of the worker's items into L2, ahead of their copies."""

    def prefetch(item):
        _, split, starts = item_window(k, item)
        blocks = _SequenceBlocks(k, it, j, split)
        for f in range(count):
            for src in blocks.sources(f, *starts):
                plgpu.async_prefetch(src, predicate=f < blocks.total)

    for rr in range(-(-k.items // k.workers)):
        item = k.worker + rr * k.workers
        pl.when(item < k.items)(lambda item=item: prefetch(item))


def own_blocks(k, it, j, q, starts, split, s):
    """This split's (sequence, block) pairs (`_SequenceBlocks`), one pass over them with
    their key and value blocks in flight (`_SequenceBlocks.stream`), an online softmax per
    sequence and head slot: per slot (max, sum, weighted values), each [kp, 8] (column b the
    sequence b's; the [8] ones broadcast over the rows). The scores are those of every q
    column against sequence b's keys, of which column b is kept (q rounded to bf16 for the
    wgmma). The softmax's sums are kept per row of a block and summed over the rows once,
    after the pass: a block's step reduces across its rows (over the warps) for the max only.
    `starts`: the first columns (ck, c0) of the key and value windows; q is in the key
    window's rows, whose first `key_cols` the key blocks hold. With two-head items (`_slots`)
    the blocks and q are a pair window's, and each block's step runs once per head slot on
    its slices of them."""
    kp, block, f32 = k.shape.kp, k.kv_block, jnp.float32
    blocks = _SequenceBlocks(k, it, j, split)
    lo, hi, total = blocks.lo, blocks.hi, blocks.total
    colidx = plgpu.broadcasted_iota(jnp.int32, (kp, N_PAD), 1, layout=WGMMA)
    block_cols = plgpu.broadcasted_iota(jnp.int32, (block, N_PAD), 1, layout=WGMMA)
    rows = plgpu.broadcasted_iota(jnp.int32, (block, N_PAD), 0, layout=WGMMA)
    s["btq"].T[...] = q.astype(jnp.bfloat16)
    plgpu.commit_smem()
    slots = _slots(k, s)

    take_keys, take_values = blocks.stream(starts, s)

    def step(f, carries):
        b, blk = blocks.pair(f)
        st = take_keys(f)
        keep = (blk != lo).astype(f32)  # 0 at a sequence's first block: start afresh
        out = []
        for e, ((keys, q_keys, values), carry) in enumerate(zip(slots, carries, strict=True)):
            m, ll, acc, m_all, l_all, acc_all = carry  # ll, l_all: [block, 8] sums per row
            m, ll, acc = m * keep + MASKED * (1.0 - keep), ll * keep, acc * keep

            def scores_of(acc_ref, keys=keys, q_keys=q_keys):
                plgpu.wgmma(acc_ref, keys(st), q_keys)
                return acc_ref[...]

            sc = pl.run_scoped(scores_of, plgpu.ACC((block, N_PAD), f32))
            sc = jnp.where(rows + blk * block < k.pos, sc, MASKED)
            m_new = jnp.maximum(m, jnp.max(sc, axis=0))
            alpha = jnp.exp(m - m_new)
            pr = jnp.exp(sc - bcast_rows(m_new, block))
            ll = ll * bcast_rows(alpha, block) + pr
            s["pb"].T[...] = pr.astype(jnp.bfloat16)
            plgpu.commit_smem()

            if e == 0:  # pair f's value block, which every slot's weighted values read
                st_values = take_values(f)

            def pv(acc_ref, values=values, st_values=st_values):
                plgpu.wgmma(acc_ref, values(st_values), s["pb"].T)
                return acc_ref[...]

            acc = acc * bcast_rows(alpha, kp) + pl.run_scoped(pv, plgpu.ACC((kp, N_PAD), f32))
            last = jnp.where(blk == hi - 1, b, -1)  # column b at its last block
            m_all = jnp.where(colidx == last, bcast_rows(m_new, kp), m_all)
            l_all = jnp.where(block_cols == last, ll, l_all)
            acc_all = jnp.where(colidx == last, acc, acc_all)
            out.append((m_new, ll, acc, m_all, l_all, acc_all))
        return tuple(out)

    def tile(rows, value):
        return plgpu.layout_cast(jnp.full((rows, N_PAD), value, f32), WGMMA)

    m0 = plgpu.layout_cast(jnp.full((N_PAD,), MASKED, f32), WGMMA.reduce(0))
    init = (m0, tile(block, 0.0), tile(kp, 0.0), tile(kp, MASKED), tile(block, 0.0), tile(kp, 0.0))
    done = lax.fori_loop(0, total, step, (init,) * len(slots))
    return [
        (m_all, bcast_rows(jnp.sum(l_rows, axis=0), kp), acc_all)
        for _, _, _, m_all, l_rows, acc_all in done
    ]


def _slots(k, s):
    """The blocks' operands per head slot: (keys(stage), q's B operand, values(stage)): one
    slot, the whole key and value blocks; with two-head items two, slot e the key blocks'
    columns [e head_dim, (e + 1) head_dim), and the kp value columns from
    `FusedShape.pair_slot_start(e)` (the window's first kp, or its last)."""
    shape = k.shape
    if not k.head_pairs:
        q_keys = s["btq"].at[:, pl.ds(0, shape.key_cols)].T
        return [(lambda st: s["kblk"].at[st], q_keys, lambda st: s["vblk"].at[st].T)]
    hd, kp = shape.head_dim, shape.kp

    def slot(e):
        keys = pl.ds(e * hd, hd)
        values = pl.ds(shape.pair_slot_start(e), kp)
        return (
            lambda st: s["kblk"].at[st, :, keys],
            s["btq"].at[:, keys].T,
            lambda st: s["vblk"].at[st, :, values].T,
        )

    return [slot(0), slot(1)]


def partials_out(k, index, parts, buf, flag=None) -> None:
    """A split's (max, sum, weighted values) of a head into `k.parts` at `index` (head
    splits + split) through `buf` ([kp + 64, 8] of shared memory); then counts it on the
    head's flag `flag`, where given."""
    kp = k.shape.kp
    m_all, l_all, acc_all = parts
    ml = in_row(jnp.max(m_all, axis=0), 0) + in_row(jnp.max(l_all, axis=0), 1)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    buf.at[pl.ds(0, kp)][...] = acc_all
    buf.at[pl.ds(kp, SCALAR_ROWS)][...] = ml
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buf.at[pl.ds(0, kp + SCALAR_ROWS)], k.parts.at[index])
    plgpu.wait_smem_to_gmem(0)
    if flag is not None:
        plgpu.semaphore_signal(k.flags.at[flag], 1, memory_scope="gpu")


def merge(m_all, l_all, acc_all, m_o, l_o, acc_o):
    """Two online softmaxes' (max, sum, weighted values) as one."""
    m_new = jnp.maximum(m_all, m_o)
    wa, wo = jnp.exp(m_all - m_new), jnp.exp(m_o - m_new)
    return m_new, l_all * wa + l_o * wo, acc_all * wa + acc_o * wo


def merge_others(k, it, j, h, merged, others, wait_flags, s):
    """`merged` with the partials of head h's splits `others` (after its flag counts the
    layer's, where `wait_flags`): copied into the combine's buffers (`pins`) as many at once
    as there are buffers, then merged in order."""
    kp = k.shape.kp
    if wait_flags:
        target = jnp.asarray((it * k.shape.layers + j + 1) * (k.splits - 1), jnp.int32)
        plgpu.semaphore_wait(k.flags.at[h], target, decrement=False, memory_scope="gpu")
    buffers = [(s["pins"].at[i], s["pinbar"].at[i]) for i in range(s["pins"].shape[0])]
    for w0 in range(0, len(others), len(buffers)):
        chunk = others[w0 : w0 + len(buffers)]
        wave = list(zip(chunk, buffers[: len(chunk)], strict=True))
        for other, (buf, bar) in wave:
            plgpu.copy_gmem_to_smem(k.parts.at[h * k.splits + other], buf, bar)
        for _, (buf, bar) in wave:
            plgpu.barrier_wait(bar)
            acc_o = plgpu.load(buf.at[pl.ds(0, kp)], layout=WGMMA)
            ml = plgpu.load(buf.at[pl.ds(kp, SCALAR_ROWS)], layout=WGMMA)
            merged = merge(*merged, row_of(ml, 0, kp), row_of(ml, 1, kp), acc_o)
    return merged


def add_head_rows(k, it, j, merged, c0, valid, s) -> None:
    """The head's merged softmax, normalised, added into layer j's attention output at the
    rows of its value window (first column c0, its rows `valid`)."""
    kp = k.shape.kp
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
