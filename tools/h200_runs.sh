#!/usr/bin/env bash
# The runs behind results/h200/, in stages; several stages can share one call on the GPU machine:
#
#   bash tools/h200_runs.sh ceilings core chain     # from the repository root, on the H200
#
#   ceilings  the device's measured ceilings (read-only streaming rate, sustained bf16 GEMM rate)
#             -> ceilings.json; every other stage states its floors against it, so run it first
#             (or have results/h200/ceilings.json from an earlier run)
#   tests     every GPU-marked test but the fused kernel's cases at huginn-0125's shapes, and the
#             PyTorch/Core/chain tests whole, in $TEST_SHARDS parallel shards (default 12;
#             correctness only; TEST_TIMEOUT: seconds, default 420)
#   tests_huginn  the fused kernel's GPU cases at huginn-0125's shapes (test_core_step_fused.py),
#             in as many parallel shards as the GPU's memory holds at 20 GiB each (a process
#             that has run one holds about 17 GB: three at once peaked at 51 GB on the H200),
#             about 100 s a case; a call of its own (HUGINN_MATCH: a grep pattern that picks
#             the cases, e.g. "-b1-"; HUGINN_TIMEOUT: seconds per shard, default 540)
#   compile_modes  the PyTorch Core through torch.compile in each mode (default, reduce-overhead,
#             max-autotune-no-cudagraphs), decode and prefill: which mode is fastest
#   core      the Core side by side (XLA impls and every PyTorch impl), decode and prefill,
#             r = 8, in $PROCESSES separate processes (default 3) -> core_N.json, then
#             core_headline.{json,txt}: median and range over the processes (CORE_MODES,
#             CORE_BATCH and CORE_IMPLS_OVERRIDE narrow it: the persistent call's headline is
#             CORE_MODES=decode CORE_IMPLS_OVERRIDE=persistent,torch_compile)
#             and core_b2b_headline.{json,txt}: the same over the back-to-back times
#   chain     the chain at 8 ... 288 MiB, every implementation, in $PROCESSES processes, the
#             first with the plot -> chain.{json,txt,png}, chain_headline.{json,txt}
#   chain_trace  where XLA's time per chain goes at 8 MiB: kernels and gaps per chain of each
#             XLA form, against PyTorch's graph
#   adapter, decode_attention, prefill_attention  one process each
#   generate  JAX generation against PyTorch's compiled decode loop, 32 steps per token
#             (CORE_DECODE=persistent: the decode steps' Core in the persistent kernel), in
#             $GEN_PROCESSES processes (default 1; from 3 on, ..._headline.{json,txt})
#   core_stream  the Core's weight stream as one persistent kernel (pallas_kernels/core_step)
#             against XLA's chain of the same products, batch 1 and 8
#   core_persistent  the whole Core iteration as one kernel (experiments.core --impls=persistent)
#             beside xla_pallas and torch_compile, decode, batch 1 and 8, one process
#   core_persistent_profile  the same call traced kernel by kernel (--trace_dir, with its HLO)
#             and its HBM bytes per iteration by Nsight Compute (--hbm), beside torch_compile's
#             ($PROFILE_IMPLS)
#   core_persistent_hbm  the persistent call beside torch_compile, batch 1, one process, and
#             its HBM bytes per iteration by Nsight Compute (the persistent call only)
#   core_persistent_b8  the same comparison at batch 8, without Nsight Compute ($B8_SCHEDULE:
#             the kernel's schedule, e.g. 3:2:0:0:64:0:0:8:0:0:1 for two-head attention items;
#             default the model's)
#   core_fused  that kernel per context, batch and schedule ($FUSED_SCHEDULES, RING:KV_STAGES,
#             in $FUSED_JOBS processes at once; $FUSED_UNIT_COLS: the weight units' width,
#             128 as recorded) against its floor and its bare weight stream, and where its time
#             goes (Mosaic GPU's on-device profiler)
#   core_fused_waits  the fused kernel's waits on its tile counters, batch 1, context 1024: the
#             default, the bound without the waits (--skip_barriers of every kind of step), the
#             waits after the weight stream's next copy (Schedule.late_inputs), 4 tiles per
#             counter (Schedule.counter_tiles) and both, at [64, 256] units and at [64, 128]
#             (four times the waits), kernel time only, 4 processes at most at once under one
#             GPU lock -> core_fused_waits_{bound,256,128}.{json,txt} (WAITS_UNITS="256" or "128":
#             one half; WAITS_TIMEOUT: seconds per half, default 280)
#   core_fused_b1  batch 1's schedules of core_fused_waits ([64, 256] units), core_fused_depths
#             and l2_resident in one call: the default beside a third key block with two value
#             blocks, 10 adapter units kept in L2, the waits after the weight copies, 4 tiles per
#             counter and both; the bound without the waits; the default's profile over 2
#             iterations (both warpgroups)
#             -> core_fused_b1{,_bound,_profile}.{json,txt} (B1_TIMEOUT: seconds, default 480)
#   core_fused_known  batch 1, context 1024, kernel time only: the default beside the same with a
#             head's step leaving out its waits on counters already complete
#             (Schedule.known_complete), 2 processes at once under one GPU lock, then both
#             profiled over 2 iterations (both warpgroups) -> core_fused_known{,_profile}.{json,txt}
#             (KNOWN_TIMEOUT: seconds, default 420)
#   core_fused_depths  the fused kernel's reads in flight, context 1024, kernel time only: at
#             batch 1 the default beside a third cached key block with two value blocks
#             (Schedule.value_stages), at batch 8 the default (3:3) beside a ring of 4 (4:3), 4
#             key blocks with 3 value blocks, a ring of 4 with 3 key blocks and 2 value blocks,
#             and 3 key blocks with 2 value blocks beside the second warpgroup and with two-head
#             items, 4 processes at most at once under one GPU lock ->
#             core_fused_depths_b{1,8}.{json,txt} (DEPTHS_TIMEOUT: seconds, default 420)
#   l2_resident  whether a weight stream keeps the units it marks evict_last in L2 from one pass
#             to the next (tools/l2_resident.py), over 512 MiB and over the Core's 3.3 GB, with
#             the driver's default L2 set-aside and with 48 MiB set aside -> l2_resident_{512,
#             core}.{json,txt}; then the fused kernel's default at batch 1 and 8 beside the same
#             with 10 adapter units per worker kept in L2 (Schedule.l2_keep), kernel time only
#             -> core_fused_l2_keep_b{1,8}.{json,txt}
#   core_fused_l2  the same with weight units and cached blocks prefetched into L2
#             (RING:KV_STAGES:L2_UNITS:L2_BLOCKS), contexts 64 and 1024
#   prefill_gemm  the Core's prefill GEMMs shape by shape, XLA against PyTorch
#   multi_gpu  tensor parallelism (docs/tensor_parallel.md): all-reduce latency and bandwidth at
#             the Core's activation sizes -> allreduce.json, then the Core (xla, xla_cudnn) on 1,
#             2 and 4 GPUs (as many as present) -> core_tpN.json, and each time against 1 GPU
#
# Each stage writes under $OUT/STAGE (default out/h200/STAGE) and packs it into $OUT/STAGE.tgz
# when it ends (a stage killed from outside packs nothing: keep each stage's timeouts inside the
# call's); $OUT/STAGE.txt keeps what the stage printed last. Carry `.wheels` (a flax wheel:
# installed only when the machine's flax lacks nnx.List).
set -u
[ $# -ge 1 ] || { echo "usage: $0 STAGE [STAGE...] (see the list above)" >&2; exit 2; }
STAGES="ceilings tests tests_huginn compile_modes core chain chain_trace adapter decode_attention prefill_attention generate core_stream core_persistent core_persistent_profile core_persistent_hbm core_persistent_b8 core_fused core_fused_waits core_fused_b1 core_fused_known core_fused_depths l2_resident core_fused_l2 prefill_gemm multi_gpu"
for stage in "$@"; do
  [[ " $STAGES " == *" $stage "* ]] || { echo "unknown stage $stage; known: $STAGES" >&2; exit 2; }
done
OUT=${OUT:-out/h200}
PROCESSES=${PROCESSES:-3}
FIRST=${FIRST:-1}  # the first process's number in core and generate (three can span two calls)
# torch.compile's mode in the experiments.core stages (fastest: every mode timed, the fastest kept)
CORE_TORCH_MODE=${CORE_TORCH_MODE:-fastest}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c "from flax import nnx; nnx.List" 2>/dev/null || pip install -q --no-deps .wheels/flax-*.whl
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,power.draw --format=csv,noheader
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
# the ceilings of the last run kept in the tree until this call measures its own
CEILINGS=""; [ -f results/h200/ceilings.json ] && CEILINGS="--ceilings=results/h200/ceilings.json"
# batch-1 schedules that several stages time: the model's default (one grid barrier per
# iteration, the cached blocks in a second warpgroup), fields appended to it for the counter
# waits (after the weight copies, 4 tiles per counter, both), a third key block beside two value
# blocks, 10 adapter units per worker kept in L2
B1_DEFAULT=3:2:0:0:64:0:0:8:1:1
B1_WAIT_FIELDS="0:1:1 0:1:0:4 0:1:1:4"
B1_VALUE_STAGES=3:3:0:0:64:0:0:8:1:1:0:1:0:1:2
B1_L2_KEEP=$B1_DEFAULT:0:1:0:1:0:10
B1_KNOWN=$B1_DEFAULT:0:1:0:1:0:0:1
HUGINN_CASES="test_core_step_fused.py::.*\[huginn-"  # the fused kernel's cases at huginn-0125's shapes
# every kind of step after which core_fused --skip_barriers can leave out a wait (a timing bound)
all_step_kinds() {
  python3 -c "from pallas_kernels.core_step.fused_plan import STEP_KINDS; print(','.join(STEP_KINDS))"
}

stage_ceilings() {
  local d=$1
  timeout 240 python3 -m experiments.ceilings --json_out="$d/ceilings.json" > "$d/ceilings.txt" 2>&1
  tail -8 "$d/ceilings.txt"
}

stage_tests() {
  # every GPU-marked test and the PyTorch/Core/chain test files whole, less the huginn-shape
  # fused cases (stage tests_huginn), split round-robin over $TEST_SHARDS parallel pytest
  # processes (compilation is CPU-bound)
  local d=$1
  local files="tests/test_torch_ref.py tests/test_core.py tests/test_generate_vs_torch.py tests/test_chain.py \
    tests/test_chain_runners.py tests/test_chain_cli.py"
  { python3 -m pytest -q --collect-only -m gpu tests; python3 -m pytest -q --collect-only $files; } \
    2>/dev/null | grep "::" | grep -v "$HUGINN_CASES" | sort -u > "$d/test_ids.txt"
  test_shards "$d" "${TEST_SHARDS:-12}" "${TEST_TIMEOUT:-420}"
}

stage_tests_huginn() {
  # the huginn-shape fused cases, one shard per 20 GiB of GPU memory (at most one per case)
  local d=$1 mib shards cases
  python3 -m pytest -q --collect-only -m gpu tests/test_core_step_fused.py 2>/dev/null \
    | grep "$HUGINN_CASES" | grep -e "${HUGINN_MATCH:-}" | sort -u > "$d/test_ids.txt"
  cases=$(wc -l < "$d/test_ids.txt")
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  shards=$((mib / 20480))
  [ "$shards" -ge 1 ] || shards=1
  [ "$shards" -le "$cases" ] || shards=$cases
  stamp "$cases cases in $shards shards ($mib MiB of GPU memory)"
  test_shards "$d" "$shards" "${HUGINN_TIMEOUT:-540}"
}

test_shards() {
  # test_shards DIR N LIMIT: DIR/test_ids.txt round-robin over N parallel pytest processes (LIMIT
  # seconds each), junit XML per shard, then the counts per file
  local d=$1 shards=$2 limit=$3 i
  for i in $(seq 0 $((shards - 1))); do
    awk -v n="$shards" -v i="$i" 'NR % n == i' "$d/test_ids.txt" > "$d/shard_$i.txt"
    xargs -a "$d/shard_$i.txt" -d '\n' timeout "$limit" python3 -m pytest -q -p no:cacheprovider \
      --junitxml="$d/junit_$i.xml" > "$d/pytest_$i.txt" 2>&1 &
  done
  wait
  for f in "$d"/pytest_*.txt; do echo "== $(basename "$f"): $(tail -1 "$f")"; done
  python3 - "$d" <<'PY'
import collections, glob, sys, xml.etree.ElementTree as ET
counts = collections.defaultdict(collections.Counter)
for path in glob.glob(f"{sys.argv[1]}/junit_*.xml"):
    for case in ET.parse(path).iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        counts[case.get("classname", "?").rsplit(".", 1)[-1]][outcome] += 1
total = collections.Counter()
for name in sorted(counts):
    total.update(counts[name])
    print(f"{name:32s} " + " ".join(f"{k} {v}" for k, v in sorted(counts[name].items())))
print(f"{'total':32s} " + " ".join(f"{k} {v}" for k, v in sorted(total.items())))
PY
}

stage_compile_modes() {
  local d=$1 mode
  for mode in default reduce-overhead max-autotune-no-cudagraphs; do
    timeout 240 python3 -m experiments.core --mode=decode,prefill --iterations=8 \
      --impls=torch_compile --torch_compile_mode="$mode" --repeats=10 $CEILINGS \
      --json_out="$d/core_$mode.json" > "$d/core_$mode.txt" 2>&1
    echo "== $mode (rc $?)"; grep -E "^(decode|prefill) |conformance|Error" "$d/core_$mode.txt" | tail -5
  done
}

CORE_IMPLS=xla,xla_cudnn,xla_pallas,xla_rows8,torch_compile,torch_graph,torch_eager,torch_reference,torch_teaching

stage_core() {
  # processes $FIRST to $PROCESSES of CORE_MODES (default decode,prefill) at batch CORE_BATCH
  # (default 1), the headline over them when they started from 1
  local d=$1 i
  for i in $(seq "$FIRST" "$PROCESSES"); do
    timeout "${CORE_TIMEOUT:-400}" python3 -m experiments.core --iterations=8 \
      --mode="${CORE_MODES:-decode,prefill}" --batch="${CORE_BATCH:-1}" \
      --impls="${CORE_IMPLS_OVERRIDE:-$CORE_IMPLS}" --torch_compile_mode="$CORE_TORCH_MODE" \
      $CEILINGS --json_out="$d/core_$i.json" > "$d/core_$i.txt" 2>&1
    stamp "core process $i rc $?"; grep -E "^(decode|prefill) " "$d/core_$i.txt"
  done
  cp "$d/core_$FIRST.json" "$d/core.json"; grep -v "it/s\]" "$d/core_$FIRST.txt" > "$d/core.txt"
  [ "$FIRST" = 1 ] || return 0
  python3 -m experiments.headline "$d"/core_[0-9]*.json --json_out="$d/core_headline.json" \
    --txt_out="$d/core_headline.txt"
  python3 -m experiments.headline "$d"/core_[0-9]*.json --metric=back_to_back \
    --json_out="$d/core_b2b_headline.json" --txt_out="$d/core_b2b_headline.txt" || true
}

stage_chain() {
  local d=$1 i sizes=${CHAIN_SIZES:-8MiB,24MiB,48MiB,72MiB,288MiB}
  timeout "${CHAIN_TIMEOUT:-300}" python3 -m experiments.chain --size="$sizes" \
    --impls=xla,xla_loop,xla_loop_f32dot,torch,pallas_splitk $CEILINGS \
    --json_out="$d/chain_1.json" --plot_out="$d/chain.png" > "$d/chain_1.txt" 2>&1
  stamp "chain process 1 rc $?"
  for i in $(seq 2 "$PROCESSES"); do
    timeout "${CHAIN_TIMEOUT:-300}" python3 -m experiments.chain \
      --size="${CHAIN_SIZES_REPEAT:-$sizes}" --impls=xla_loop,torch_graph,torch_compile,pallas_splitk \
      $CEILINGS --json_out="$d/chain_$i.json" --plot_out= > "$d/chain_$i.txt" 2>&1
    stamp "chain process $i rc $?"
  done
  cp "$d/chain_1.json" "$d/chain.json"; grep -v "it/s\]" "$d/chain_1.txt" > "$d/chain.txt"
  python3 -m experiments.headline "$d"/chain_[0-9]*.json --json_out="$d/chain_headline.json" \
    --txt_out="$d/chain_headline.txt"
}

stage_chain_trace() {
  local d=$1
  timeout 300 python3 -m experiments.chain --size=8MiB --layouts=shared \
    --impls=xla,xla_loop,xla_no_cmdbuf,xla_loop_no_cmdbuf,xla_f32dot,xla_loop_f32dot,xla_loop_unrolled,torch_graph \
    $CEILINGS --trace_dir="$d/trace" --json_out="$d/chain_trace_8MiB.json" --plot_out= \
    > "$d/chain_trace_8MiB.txt" 2>&1
  stamp "chain trace rc $?"
  timeout 120 python3 -m experiments.chain --size=8MiB,24MiB --layouts=shared --gemm=cublas \
    --impls=xla_loop,xla_loop_f32dot,torch_graph $CEILINGS --json_out="$d/chain_cublas.json" \
    --plot_out= > "$d/chain_cublas.txt" 2>&1
  stamp "chain cublas rc $?"
  rm -rf "$d"/trace/*/plugins  # the raw xplane files: large, and the tables hold what they say
  grep -v "chain:" "$d/chain_trace_8MiB.txt" | tail -45; grep -E "^ +[0-9]" "$d/chain_cublas.txt"
}

stage_adapter() {
  local d=$1
  timeout 200 python3 -m experiments.adapter --m=1,1024 $CEILINGS \
    --json_out="$d/adapter.json" > "$d/adapter.txt" 2>&1
  tail -14 "$d/adapter.txt"
}

stage_decode_attention() {
  local d=$1
  timeout 240 python3 -m experiments.decode_attention --batch=1,8 --context=1024,4096 \
    $CEILINGS --json_out="$d/decode_attention.json" > "$d/decode_attention.txt" 2>&1
  tail -20 "$d/decode_attention.txt"
}

stage_prefill_attention() {
  local d=$1
  timeout 200 python3 -m experiments.prefill_attention --tokens=1024,4096 $CEILINGS \
    --json_out="$d/prefill_attention.json" > "$d/prefill_attention.txt" 2>&1
  tail -14 "$d/prefill_attention.txt"
}

stage_generate() {
  # CORE_DECODE=persistent: JAX's decode steps through the persistent Core kernel;
  # processes $FIRST (default 1) to GEN_PROCESSES (default 1; with 3 or more from 1, a headline
  # over them), the PyTorch loops GEN_TORCH_IMPLS (default all), the conformance check in
  # process 1 only (none with GEN_CONFORMANCE=0), torch.compile's mode GEN_TORCH_MODE (default
  # fastest: every mode run, the fastest kept). A process took 150-300 s in one mode: FIRST
  # splits 3 processes over two calls (experiments.headline then combines their JSONs anywhere)
  local d=$1 name=generate_vs_torch i check=--torch_conformance
  [ "${CORE_DECODE:-xla}" = xla ] || name="generate_vs_torch_$CORE_DECODE"
  [ "$FIRST" = 1 ] && [ "${GEN_CONFORMANCE:-1}" = 1 ] || check=--notorch_conformance
  for i in $(seq "$FIRST" "${GEN_PROCESSES:-1}"); do
    timeout "${GEN_TIMEOUT:-500}" python3 -m experiments.generate_vs_torch --prompt_len=1024 \
      --max_new_tokens=32 --num_steps=32 --core_decode="${CORE_DECODE:-xla}" $check \
      --torch_impls="${GEN_TORCH_IMPLS:-torch_compile,torch_graph,torch_reference}" \
      --torch_compile_mode="${GEN_TORCH_MODE:-fastest}" \
      --json_out="$d/${name}_$i.json" > "$d/${name}_$i.txt" 2>&1
    stamp "generate process $i rc $?"
    check=--notorch_conformance
  done
  cp "$d/${name}_$FIRST.json" "$d/$name.json"
  grep -v "it/s\]" "$d/${name}_$FIRST.txt" > "$d/$name.txt"
  if [ "$FIRST" = 1 ] && [ "${GEN_PROCESSES:-1}" -ge 3 ]; then
    python3 -m experiments.headline "$d/${name}"_[0-9]*.json --json_out="$d/${name}_headline.json" \
      --txt_out="$d/${name}_headline.txt"
  fi
  tail -20 "$d/$name.txt"
}

stage_core_stream() {
  local d=$1
  timeout 240 python3 -m experiments.kernels.core_stream --batch=1 --unit_cols=64,128,256 \
    --rings=16,24 --reps=5 --json_out="$d/core_stream.json" \
    > "$d/core_stream.txt" 2>&1
  echo "== core_stream rc $?"; grep -v "it/s\]" "$d/core_stream.txt" | tail -12
}

stage_core_persistent() {
  # the fused Core kernel as the model runs it, beside XLA's fastest decode and torch.compile
  local d=$1
  timeout 520 python3 -m experiments.core --mode=decode \
    --impls=persistent,xla_pallas,torch_compile --iterations=8 --context=1024 --batch=1,8 \
    --torch_compile_mode="$CORE_TORCH_MODE" $CEILINGS --json_out="$d/core_persistent.json" \
    > "$d/core_persistent.txt" 2>&1
  echo "== core_persistent rc $?"; grep -v "it/s\]" "$d/core_persistent.txt" | tail -12
}

stage_core_persistent_profile() {
  # where the model's persistent Core call spends its time beyond the kernel (per-kernel trace
  # with the gaps) and the HBM bytes it reads per iteration (Nsight Compute), beside
  # torch_compile's; batch 1, context 1024
  local d=$1
  local impls=${PROFILE_IMPLS:-persistent,torch_compile}
  timeout "${PROFILE_TIMEOUT:-560}" python3 -m experiments.core --mode=decode --impls="$impls" \
    --iterations=8 --context=1024 --batch=1 --trace_dir="$d/trace" --hlo_dir="$d/hlo" --hbm \
    --hbm_impls="$impls" --torch_compile_mode="$CORE_TORCH_MODE" $CEILINGS \
    --json_out="$d/core_persistent_profile.json" \
    > "$d/core_persistent_profile.txt" 2>&1
  echo "== core_persistent_profile rc $?"
  grep -v "it/s\]" "$d/core_persistent_profile.txt" | grep -v "^AUTOTUNE\|triton_mm\|strides:\|dtypes:" | tail -40
}

stage_core_persistent_hbm() {
  local d=$1
  timeout "${HBM_TIMEOUT:-590}" python3 -m experiments.core --mode=decode \
    --impls=persistent,torch_compile --iterations=8 --context=1024 --batch=1 --hbm \
    --hbm_impls=persistent --ncu_timeout="${NCU_TIMEOUT:-380}" \
    --torch_compile_mode="$CORE_TORCH_MODE" $CEILINGS \
    --json_out="$d/core_persistent_hbm.json" > "$d/core_persistent_hbm.txt" 2>&1
  echo "== core_persistent_hbm rc $?"
  grep -v "it/s\]" "$d/core_persistent_hbm.txt" | grep -v "^AUTOTUNE\|triton_mm\|strides:\|dtypes:" | tail -25
}

stage_core_persistent_b8() {
  local d=$1
  timeout 300 python3 -m experiments.core --mode=decode --impls=persistent,torch_compile \
    --iterations=8 --context=1024 --batch=8 --torch_compile_mode="$CORE_TORCH_MODE" $CEILINGS \
    --persistent_schedule="${B8_SCHEDULE:-}" --json_out="$d/core_persistent_b8.json" \
    > "$d/core_persistent_b8.txt" 2>&1
  echo "== core_persistent_b8 rc $?"; grep -E "^(mode|decode|conformance)" "$d/core_persistent_b8.txt"
}

fused_run() {
  # fused_run DIR NAME CONTEXTS SCHEDULES JOBS: experiments.kernels.core_fused -> DIR/NAME.{json,txt}
  local d=$1 name=$2
  timeout "${FUSED_TIMEOUT:-540}" python3 -m experiments.kernels.core_fused --batch=1,8 \
    --contexts="$3" --schedules="$4" --jobs="$5" --profile --json_out="$d/$name.json" \
    --unit_cols="${FUSED_UNIT_COLS:-128}" > "$d/$name.txt" 2>&1
  echo "== $name rc $?"; grep -v "it/s\]" "$d/$name.txt" | tail -30
}

stage_core_fused() {
  fused_run "$1" core_fused 64,1024,4096 "${FUSED_SCHEDULES:-8:2,6:3}" "${FUSED_JOBS:-1}"
}

stage_core_fused_waits() {
  local d=$1 lock=/tmp/core_fused_waits.lock dataflow=$B1_DEFAULT ring6=6:2:0:0:64:0:0:8:1:1
  waits_run() {  # waits_run NAME JOBS FLAGS...
    local name=$1 jobs=$2
    shift 2
    fused_call "$d" "core_fused_waits_$name" "$lock" "${WAITS_TIMEOUT:-280}" "$jobs" --batch=1 "$@"
  }
  local at256="$dataflow" at128="$ring6" v
  for v in $B1_WAIT_FIELDS; do at256="$at256,$dataflow:$v"; at128="$at128,$ring6:$v"; done
  if [[ " ${WAITS_UNITS:-256 128} " == *" 256 "* ]]; then
    waits_run bound 1 --schedules="$dataflow" --skip_barriers="$(all_step_kinds)" &
    waits_run 256 3 --schedules="$at256"
    wait  # then [64, 128]: 4 processes at most at once
  fi
  if [[ " ${WAITS_UNITS:-256 128} " == *" 128 "* ]]; then
    waits_run 128 4 --unit_cols=128 --schedules="$at128"
  fi
  for f in "$d"/core_fused_waits_*.txt; do grep -v "it/s\]" "$f" | tail -6; done
}

stage_core_fused_b1() {
  # the batch-1 schedules of core_fused_waits ([64, 256] units), core_fused_depths and
  # l2_resident in one call, with the default's profile
  local d=$1 lock=/tmp/core_fused_b1.lock s=$B1_DEFAULT limit=${B1_TIMEOUT:-480} v
  local schedules="$s,$B1_VALUE_STAGES,$B1_L2_KEEP"
  for v in $B1_WAIT_FIELDS; do schedules="$schedules,$s:$v"; done
  fused_call "$d" core_fused_b1 "$lock" "$limit" 3 --batch=1 --schedules="$schedules" &
  fused_call "$d" core_fused_b1_bound "$lock" "$limit" 1 --batch=1 --schedules="$s" \
    --skip_barriers="$(all_step_kinds)" &
  fused_call "$d" core_fused_b1_profile "$lock" "$limit" 1 --batch=1 --iterations=2 --profile \
    --schedules="$s" &
  wait
  for f in "$d"/core_fused_b1*.txt; do grep -v "it/s\]" "$f" | tail -10; done
}

stage_core_fused_known() {
  local d=$1 lock=/tmp/core_fused_known.lock limit=${KNOWN_TIMEOUT:-420}
  local schedules="$B1_DEFAULT,$B1_KNOWN"
  fused_call "$d" core_fused_known "$lock" "$limit" 2 --batch=1 --schedules="$schedules" &
  fused_call "$d" core_fused_known_profile "$lock" "$limit" 2 --batch=1 --iterations=2 --profile \
    --schedules="$schedules" &
  wait
  for f in "$d"/core_fused_known*.txt; do grep -v "it/s\]" "$f" | tail -12; done
}

fused_call() {
  # fused_call DIR NAME LOCK TIMEOUT JOBS FLAGS...: core_fused at context 1024, 20 calls a row,
  # kernel time only, GPU work under the file lock LOCK -> DIR/NAME.{json,txt}
  local d=$1 name=$2 lock=$3 limit=$4 jobs=$5
  shift 5
  timeout "$limit" python3 -m experiments.kernels.core_fused --contexts=1024 --nostream \
    --reps=20 --gpu_lock="$lock" --jobs="$jobs" "$@" --json_out="$d/$name.json" \
    > "$d/$name.txt" 2>&1
  stamp "$name rc $?"
}

fused_batches() {
  # fused_batches DIR NAME TIMEOUT B1_SCHEDULES B8_SCHEDULES: core_fused at batch 1 and 8 at once,
  # 2 processes each under one GPU lock, kernel time only -> NAME_b{1,8}.{json,txt}
  local d=$1 name=$2 limit=$3
  fused_call "$d" "${name}_b1" "/tmp/$name.lock" "$limit" 2 --batch=1 --schedules="$4" &
  fused_call "$d" "${name}_b8" "/tmp/$name.lock" "$limit" 2 --batch=8 --schedules="$5" &
  wait
  for f in "$d/${name}"_b*.txt; do grep -v "it/s\]" "$f" | tail -8; done
}

stage_core_fused_depths() {
  local b1="$B1_DEFAULT,$B1_VALUE_STAGES"
  local b8="3:3,4:3,3:4:0:0:64:0:0:8:0:0:0:1:0:1:3,4:3:0:0:64:0:0:8:0:0:0:1:0:1:2"
  b8="$b8,3:3:0:0:64:0:0:8:1:0:0:1:0:1:2,3:3:0:0:64:0:0:8:0:0:1:1:0:1:2"
  fused_batches "$1" core_fused_depths "${DEPTHS_TIMEOUT:-420}" "$b1" "$b8"
}

stage_l2_resident() {
  local d=$1 name mib
  for name in 512 core; do
    [ "$name" = 512 ] && mib=512 || mib=3300
    timeout 200 python3 tools/l2_resident.py --mib="$mib" --json_out="$d/l2_resident_$name.json" \
      > "$d/l2_resident_$name.txt" 2>&1
    stamp "l2_resident_$name rc $?"
    tail -12 "$d/l2_resident_$name.txt"
  done
  fused_batches "$d" core_fused_l2_keep "${KEEP_TIMEOUT:-300}" \
    "$B1_DEFAULT,$B1_L2_KEEP" 3:3,3:3:0:0:64:0:0:8:0:0:0:1:0:1:0:10
}

stage_core_fused_l2() {
  # the L2 prefetches of the schedule against none; 5 processes compile at once, each held to
  # 18 % of the GPU's memory (more at once ran the GPU out of memory)
  (export XLA_PYTHON_CLIENT_MEM_FRACTION=0.18
   fused_run "$1" core_fused_l2 64,1024 6:3,6:3:8,6:3:16,6:3:8:4,6:3:16:4 5)
}

stage_prefill_gemm() {
  # the Core's prefill GEMMs shape by shape, with XLA's default cuBLAS and with cuBLASLt
  local d=$1
  timeout 150 python3 -m experiments.kernels.prefill_gemm $CEILINGS \
    --json_out="$d/prefill_gemm.json" > "$d/prefill_gemm.txt" 2>&1
  timeout 150 python3 -m experiments.kernels.prefill_gemm $CEILINGS \
    --xla_flags=--xla_gpu_enable_cublaslt=true --json_out="$d/prefill_gemm_cublaslt.json" \
    > "$d/prefill_gemm_cublaslt.txt" 2>&1
  echo "== prefill_gemm rc $?"; grep -v "it/s\]" "$d/prefill_gemm.txt" | tail -8
}

stage_multi_gpu() {
  local d=$1 n mesh gpus
  gpus=$(nvidia-smi -L | wc -l)
  timeout 300 python3 -m experiments.allreduce --batch=1,8 --context=1024,4096 \
    --json_out="$d/allreduce.json" > "$d/allreduce.txt" 2>&1
  stamp "allreduce rc $?"; grep -v "it/s\]" "$d/allreduce.txt" | tail -20
  for n in 1 2 4; do
    [ "$n" -le "$gpus" ] || { echo "== $n GPUs: only $gpus present, skipped"; continue; }
    mesh=""; [ "$n" -gt 1 ] && mesh="--mesh=model:$n"
    timeout "${CORE_TIMEOUT:-400}" python3 -m experiments.core --mode=decode,prefill \
      --iterations=8 --impls=xla,xla_cudnn $mesh $CEILINGS --json_out="$d/core_tp$n.json" \
      > "$d/core_tp$n.txt" 2>&1
    stamp "core on $n GPU(s) rc $?"
  done
  python3 - "$d" <<'PY'
import json, pathlib, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("core_tp*.json")):
    for r in json.loads(path.read_text())["records"]:
        runs[(int(path.stem[7:]), r["mode"], r["batch"], r["context"], r["impl"])] = r
for (n, mode, b, ctx, impl), r in sorted(runs.items()):
    one = runs.get((1, mode, b, ctx, impl))
    ratio = f"{r['ms_per_iteration'] / one['ms_per_iteration']:.3f} x 1 GPU" if one else "-"
    print(f"{n} GPU(s) {impl:10s} {mode:8s} B={b} ctx={ctx}: {r['ms_per_iteration']:.3f} ms/iter, {ratio}")
PY
}

for stage in "$@"; do
  d="$OUT/$stage"
  mkdir -p "$d"
  stamp "stage $stage"
  "stage_$stage" "$d" 2>&1 | tee "$OUT/$stage.txt"
  if [ "$stage" = ceilings ] && [ -f "$d/ceilings.json" ]; then
    CEILINGS="--ceilings=$d/ceilings.json"
  fi
  tar -czf "$OUT/$stage.tgz" -C "$OUT" "$stage"
done
stamp "all stages done"
