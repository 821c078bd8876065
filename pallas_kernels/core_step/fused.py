"""The whole Core decode iteration as one persistent kernel (Mosaic GPU, Hopper).

The weight stream of `stream.py` (a TMA ring per worker that runs ahead across the grid
barriers, [64, unit_cols] weight units as the wgmma A operand, partial sums reduce-added into
each product's output) with the rest of the iteration fused in, as `step_program.py` specifies,
so that most products take their input as it is, as the bare stream does:

- the norms' gains are folded into the weights' rows (`fused_step.pack_weights`); their
  rsqrt(mean(z²) + eps) scales a product's output after its barrier. The sums of squares are
  reduced beside a product, from its input chunks, by the worker that owns the chunk's unit in
  tile kc mod tiles (so the owners spread over the workers); with `Schedule.dataflow`, worker
  w reduces chunks w, w + workers, ... of its own at the product's start
  (`fused_products.Products.own_chunks`);
- the residuals are added into the products' outputs: at the end of proj and of the mlp proj,
  each worker reduce-adds its chunks of x g rsqrt(...) into the output, so that the output is
  the next product's input;
- two products build their input per unit: layer 0's qkv (a r + e @ Wa[D:], r the state's norm
  from the adapter step, stored for layer 0's residual) and the mlp proj (the SiLU gate of the
  scaled fc output); the first iteration's adapter multiplies the given state by the adapter's
  own rows (later ones by the rows with norm_4 folded in);
- between qkv and proj, the attention step (`fused_attention.py`). With `Schedule.overlap`
  each worker's qkv units are two ranges, its share of the tiles that hold q, then of the
  rest; once every worker has put out the first (a counter, not a barrier), a second
  warpgroup per worker runs its attention item's cached blocks while the first streams the
  second range. Each warpgroup's scopes of shared memory are then a union of their own.

1 + 5 L hand-overs per iteration: grid barriers, but after proj and after an MLP proj that a qkv
follows, where the next product's first units wait for the tiles of their input on counters
(`fused_plan.Schedule.handover`); with `Schedule.dataflow`, one grid barrier, after the
iteration's last product, and every other step on counters (`fused_counters.py`), the
activations in two sets of buffers used in turn by the iterations. Activations are [rows, 8]
float32 (`fused_plan.py`).
This module orders the steps and their barriers; the products are `fused_products.py` (their
weights `fused_ring.py`), the attention `fused_attention.py`.
Reference: `step_program.core_iteration`; inputs and outputs: `fused_step.py`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.core_step.fused_attention import attention_step, blocks_ahead
from pallas_kernels.core_step.fused_fit import (
    REDUCTION_SCRATCH,
    SCOPES,
    WARPGROUP_SCOPES,
    check_fused,
    profile_ranges,
    scoped,
    scratch_types,
    second_warpgroup_types,
    union_layout,
)
from pallas_kernels.core_step.fused_inputs import KernelContext
from pallas_kernels.core_step.fused_plan import (
    DEFAULT_SCHEDULE,
    N_PAD,
    PRODUCT_KINDS,
    SCALAR_ROWS,
    STEP_KINDS,
    Buffers,
    FusedShape,
    Schedule,
    attention_items,
    kind_of,
)
from pallas_kernels.core_step.fused_products import Products
from pallas_kernels.looped_matmul.barrier import GridBarrier


def build_fused_core(
    shape: FusedShape,
    iterations: int,
    *,
    workers: int,
    eps: float,
    schedule: Schedule = DEFAULT_SCHEDULE,
    x_stages: int = 2,
    interpret: Any = None,
    profile_dir: str = "",
    skip_barriers: tuple[str, ...] = (),
):
    """Returns f(meta, state0, e_part, gains, tables, rope_bias, k_cache, v_cache, *weights)
    -> (act, scalars, partials, kv_new), weights one array per kind of product
    (`FusedShape.weight_shapes`); `fused_step.py` builds the inputs and reads the outputs.
    `schedule` (`fused_plan.Schedule`): `ring` weight units in flight per worker into shared
    memory, `kv_stages` cached key blocks (and `Schedule.stages_of_values` value blocks) of
    `kv_block` positions in flight in the attention; `l2_units` > 0 also prefetches into L2
    the unit that many further on, `l2_blocks` > 0 each attention item's first blocks,
    `l2_barrier` and `l2_attention` the next product's units after the ring's once the worker
    has arrived at the barrier after a product (all slower on the H200 than without:
    docs/core_step.md).
    Interpret mode: one worker (no global semaphores; prefetches are no-ops). `profile_dir`:
    Mosaic GPU's on-device profiler records every step's, barrier's (also by the kind of step
    it follows: after_qkv, after_attn, ...) and attention part's (`fused_fit.ATTENTION_PARTS`)
    entry and exit (SM clock) there, with `Schedule.overlap` the second warpgroup's parts
    (`fused_fit.SECOND_WARPGROUP_PARTS`) in a trace of its own. `skip_barriers`: kinds of step
    (`fused_plan.STEP_KINDS`) after which the grid barrier is left out, the last of an
    iteration kept, or with `Schedule.dataflow` the next product's units' waits on those steps'
    output tiles (`Counters.wait_input`): a timing bound of what those barriers or waits cost,
    whose results are wrong."""
    if set(skip_barriers) - set(STEP_KINDS):
        raise ValueError(f"skip_barriers={skip_barriers}: each must be one of {STEP_KINDS}")
    if interpret is not None and workers != 1:
        raise ValueError("interpret mode runs one worker only (no grid barrier)")
    if schedule.overlap and interpret is not None:
        raise ValueError("overlap runs two warpgroups per worker: on the GPU only")
    if interpret is None and (shape.head_dim % 16 or (shape.d - shape.kp) % 16):
        raise ValueError(
            f"head_dim={shape.head_dim} and d - {shape.kp} must be multiples of 16: a head's "
            "cache columns are copied into tiles of 16 columns"
        )
    check_fused(shape, workers, schedule, x_stages, iterations if profile_dir else 0)
    phases, layers = shape.phases, shape.layers
    n_phases, n_kinds = len(phases), len(PRODUCT_KINDS)
    items, splits = attention_items(shape, workers, bool(schedule.head_pairs))
    overlap = bool(schedule.overlap)
    steps_per_iteration = shape.steps_per_iteration
    barrier_of = {}  # step -> its barrier's place in the iteration, for the barriers kept
    for step, kind in enumerate(shape.step_kinds):
        last = step == steps_per_iteration - 1
        if last or not (kind in skip_barriers or schedule.dataflow):
            barrier_of[step] = len(barrier_of)
    parities = 2 if schedule.dataflow else 1  # sets of activation buffers (`KernelContext.acts`)
    f32 = jnp.float32

    def body(meta, state, e_part, gains, tables, rope_bias, k_cache, v_cache, *refs):
        w_refs = dict(zip(PRODUCT_KINDS, refs[:n_kinds], strict=True))
        act, scal, parts, kv_new = refs[n_kinds : n_kinds + 4]
        worker = lax.axis_index("b")
        named = dict(zip(SCRATCH_NAMES, refs[n_kinds + 4 :], strict=True))
        k = KernelContext(
            shape=shape, eps=eps, workers=workers, splits=splits, items=items,
            reduce=workers > 1, worker=worker, meta=meta, pos=meta[0], act=act, scal=scal,
            parts=parts, kv_new=kv_new, tables=tables, rope_bias=rope_bias, k_cache=k_cache,
            v_cache=v_cache, s={name: named[name] for name in scratch},
            scope=scopes_of(named, "first"), kv_stages=schedule.kv_stages,
            value_stages=schedule.stages_of_values, kv_block=schedule.kv_block, overlap=overlap,
            parts_ready=named.get("second.parts_ready"), parities=parities,
            dataflow=bool(schedule.dataflow), head_pairs=bool(schedule.head_pairs),
            flags=pl.get_global(plgpu.SemaphoreType.REGULAR((shape.heads,)))
            if splits > 1 else None,
            q_done=pl.get_global(plgpu.SemaphoreType.REGULAR) if overlap else None,
            interpreted=interpret is not None,
        )  # fmt: skip
        barrier = GridBarrier(workers, "wait", 0, 1) if k.reduce else None
        inputs = dict(weights=w_refs, state=state, e_part=e_part, gains=gains)
        ps = Products(k, schedule, iterations, x_stages, skip_barriers, inputs, barrier)
        k.counters = ps.counters

        def epoch_of(it, step):
            return 2 + it * len(barrier_of) + barrier_of[step]

        def cross(it, step, after: str, while_waiting=lambda: None, wait=True):
            """The grid barrier after step `step`, a step of kind `after` (its profiled range is
            also "after_" + that kind); `while_waiting()` between the worker's arrival and its
            wait. `wait` False: the arrival only (the next product waits, `hands_over`)."""
            if not k.reduce or step not in barrier_of:
                while_waiting()
                return
            epoch = epoch_of(it, step)

            def go():
                with jax.named_scope("barrier"), jax.named_scope(f"after_{after}"):
                    barrier.arrive()
                    while_waiting()
                    if wait:
                        barrier.wait(epoch)

            if step == steps_per_iteration - 1:
                pl.when(it < iterations - 1)(go)
            else:
                go()

        def iteration(it):
            step, handed = 0, None
            for p in range(n_phases):
                with jax.named_scope(phases[p].name):
                    ps.product(it, p, handed)
                plgpu.wait_smem_to_gmem(0)
                if ps.signals(p):
                    ps.signal_tiles(p)
                kind, j = kind_of(phases[p].name)
                cross(it, step, kind, partial(ps.prefetch_next, it, p), wait=not ps.hands_over(p))
                handed = epoch_of(it, step) if ps.hands_over(p) else None
                step += 1
                if kind == "qkv":
                    with jax.named_scope(f"attn{j}"):
                        attention_step(k, it, j)
                    plgpu.wait_smem_to_gmem(0)
                    cross(it, step, "attn")
                    step += 1

        def streams():
            ps.prologue()
            pl.loop(0, iterations)(iteration)

        if not overlap:
            streams()
            return
        # Two warpgroups: the second runs the attention items' blocks (`blocks_ahead`) inside
        # a scope of its own, so that its reductions across warps take other bytes of shared
        # memory than the first's.
        wg = lax.axis_index("wg")
        k2 = KernelContext(**{
            **k.__dict__, "scope": scopes_of(named, "second"),
            "s": {**k.s, **{name: named["second." + name] for name in second}},
        })  # fmt: skip

        def second_warpgroup(pad):
            del pad

            @pl.when(jnp.logical_and(wg == 1, worker < k.items))
            def _():
                @pl.loop(0, iterations)
                def _(it):
                    for j in range(layers):
                        blocks_ahead(k2, it, j, worker)

        pad = plgpu.SMEM((REDUCTION_SCRATCH,), jnp.int8)
        pl.run_scoped(second_warpgroup, pad, collective_axes="wg")
        pl.when(wg == 0)(streams)

    scratch, *scopes = scratch_types(shape, schedule, x_stages, workers)
    groups = dict(zip(SCOPES, scopes, strict=True))
    second = second_warpgroup_types(shape)
    layout = dict(scratch)
    if overlap:
        for union, names in WARPGROUP_SCOPES.items():
            layout |= union_layout(union, {g: groups[g] for g in names})
        layout |= {"second." + name: t for name, t in second.items()}

    def scopes_of(named, union):
        """k.scope(name, fn): fn(the buffers and barriers of scope `name`), those of `union`
        (`WARPGROUP_SCOPES`) where two warpgroups run, else inside `fused_fit.scoped`."""
        if not overlap:
            return lambda name, fn: scoped(groups[name], fn)
        members = dict(zip(WARPGROUP_SCOPES[union], named[union], strict=True))

        def scope(name, fn):
            barriers = {
                b: named[f"{union}.{name}.{b}"]
                for b, t in groups[name].items()
                if isinstance(t, plgpu.Barrier)
            }
            return fn({**members[name], **barriers})

        return scope

    SCRATCH_NAMES, kp = tuple(layout), shape.kp
    out_type = (
        jax.ShapeDtypeStruct((parities, Buffers.count(layers), shape.buffer_rows, N_PAD), f32),
        jax.ShapeDtypeStruct((2, SCALAR_ROWS, N_PAD), f32),
        jax.ShapeDtypeStruct((shape.heads * splits, kp + SCALAR_ROWS, N_PAD), f32),
        jax.ShapeDtypeStruct((iterations, layers, 2, shape.heads, N_PAD, kp), jnp.bfloat16),
    )
    params = plgpu.CompilerParams()
    if profile_dir:
        ranges = profile_ranges(shape, workers, iterations, schedule)
        params = plgpu.CompilerParams(profile_space=ranges, profile_dir=profile_dir)
    threads = dict(num_threads=2, thread_name="wg") if overlap else {}
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=tuple(layout.values()),
        grid=(workers,),
        grid_names=("b",),
        compiler_params=params,
        interpret=interpret,
        **threads,
    )
