#!/usr/bin/env bash
# Device runs for the open issues, in stages; several stages can share one device call:
#
#   bash tools/h200_session.sh tests pallas chain   # one call: GPU tests, kernels, chain + ncu
#
#   tests     GPU-only tests (Pallas kernels, cuDNN attention) and the model, generation, Core and
#             PyTorch reference tests on the GPU, pytest processes side by side (compilation is
#             CPU-bound; correctness only); TEST_GROUPS picks groups (default "kernels
#             attention model"), TEST_TIMEOUT the limit of each process (default 280 s)
#   pallas    issue 4: both kernel variants against XLA at the issue's sizes, one table
#   pallas_steps  issue 4: split-K time against steps at 8 and 24 MiB (the per-step cost)
#   pallas_barrier  issue 4: the grid barrier alone and split-K steps, for each way of polling
#             (BARRIER_ONLY: a comma list of cases instead of the whole suite)
#   pallas_l2 issue 4: split-K steps with the whole weight streamed from L2 vs on chip, 8 and
#             24 MiB (the L2 read cost per step)
#   chain_nocb  issue 4: the split-K chain with and without XLA command buffers at 24 and 8 MiB
#             (where the ~13 us per chain between kernel time and chain time goes)
#   chain     issues 3 + 4: xla_loop / torch_graph / $CHAIN_PALLAS (default both Pallas
#             kernels) at 8/24/48/72/288 MiB with ncu; a trace at 72 MiB
#   chain_hbm the ncu part of `chain` alone
#   core      issue 5: Core decode/prefill with traces + HLO, batch/context sweep (CORE_ARGS:
#             flags appended to the main run, e.g. --mode=decode; SWEEP_IMPLS: the sweep's impls)
#   core_hbm  issue 5: the Core's HBM bytes (ncu; CORE_HBM_ARGS: flags appended)
#   adapter   issue 5: the adapter against its roofline, HBM bytes with L2 flushed (ncu)
#   core_xla_gemm  issue 5: the Core with XLA's own GEMM choice (Triton), against the default
#             --gemm=cublas of the other stages
#   core_flags  issue 5: decode under XLA flag variants (command buffers, loop unrolling)
#   gemv      issue 5: the fused row GEMV's configs against XLA on the Core's five decode GEMVs
#             (GEMV_ARGS: more flags, e.g. --configs=64:64:4:1 --shapes=qkv)
#   core_rows issue 5: Core decode, the row-GEMV path (xla_rows) against xla, xla_pallas and
#             PyTorch's graph, r = 1 and 8, with traces (CORE_ROWS_ARGS: flags appended)
#   core_prefill  issue 5: Core prefill, cuDNN against Mosaic GPU attention and PyTorch's graph,
#             r = 8, with traces (CORE_PREFILL_ARGS: flags appended)
#   core_cb   issue 5: Core decode (xla_pallas, xla_rows; r = 1, 8) and prefill (xla_cudnn,
#             xla_mgpu; r = 8) against PyTorch's graph, with XLA's command buffers on and off
#             (one process each), traces with them off
#   core_clocks  issue 5: SM clock and power (nvidia-smi, every 100 ms) while the Core's prefill
#             runs, r = 1 then r = 8 (xla_cudnn)
#   gemm_clocks  issue 5: the bf16 GEMM rate in bursts of 10 and sustained over 100 and 400
#             8192^3 matmuls, with the SM clock and power per phase
#   hbm_read  issue 5: the read-only streaming rate (XLA reduction, cuBLAS GEMV over 2 GiB and
#             at the Core's shapes) and XLA's copy rate, CUPTI device time
#   prefill_attention  issue 5: one layer's causal prefill attention, XLA, cuDNN, Mosaic GPU,
#             PyTorch, T = 1024 and 4096
#   decode_attention  issue 5: one layer's decode attention, XLA, cuDNN, Pallas, PyTorch
#             (DA_BATCH, default 1,8; DA_ARGS: more flags, e.g. --impls=pallas
#             --pallas_configs=4:32:4:1,8:64:4:2)
#   generate  issue 6: JAX vs PyTorch per-token latency, breakdown, peak memory at 4096
#   generate_mem  issue 6: peak memory at 4096 alone
#   train     issue 7: training run and the accuracy curve (TRAIN_SECONDS, default 150), then the
#             Core with the trained and with random weights (time and ncu HBM bytes)
#
# Run from the repository root on the H200 machine (its own python3 with jax 0.11.2 and torch);
# carry `.wheels` (made here with `pip download --no-deps -d .wheels flax==0.12.12`; installed
# there only if the image's flax, 0.12.10 on 2026-11-30, lacks nnx.List).
# Each stage writes under $OUT/STAGE, packed into $OUT/STAGE.tgz as soon as the stage ends (at
# most 8 files come back); $OUT/STAGE.txt keeps the stage's summary lines.
set -u
[ $# -ge 1 ] || { echo "usage: $0 STAGE [STAGE...] (see the list above)" >&2; exit 2; }
for stage in "$@"; do
  case "$stage" in
  tests | pallas | pallas_steps | pallas_barrier | pallas_l2 | chain_nocb | chain | chain_hbm | core | core_hbm | adapter) ;;
  core_xla_gemm | core_flags | decode_attention | prefill_attention | generate | generate_mem | train) ;;
  gemv | core_rows | core_prefill | core_cb | core_clocks | gemm_clocks | hbm_read) ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c "from flax import nnx; nnx.List" 2>/dev/null || pip install -q --no-deps .wheels/flax-*.whl
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }

stage_tests() {
  local d=$1 groups=" ${TEST_GROUPS:-kernels attention model} " limit=${TEST_TIMEOUT:-280}
  if [[ $groups == *" kernels "* ]]; then
    timeout "$limit" python3 -m pytest -q -m gpu tests/test_looped_matmul.py -k "not splitk" \
      > "$d/pytest_resident.txt" 2>&1 &
    timeout "$limit" python3 -m pytest -q -m gpu tests/test_looped_matmul.py -k splitk \
      > "$d/pytest_splitk.txt" 2>&1 &
  fi
  if [[ $groups == *" attention "* ]]; then
    timeout "$limit" python3 -m pytest -q tests/test_decode_attention_kernel.py \
      tests/test_decode_attention.py tests/test_prefill_attention.py tests/test_model.py \
      tests/test_fused_gemv.py \
      > "$d/pytest_attention_model.txt" 2>&1 &
  fi
  if [[ $groups == *" model "* ]]; then
    timeout "$limit" python3 -m pytest -q tests/test_torch_ref.py tests/test_generate.py \
      > "$d/pytest_torch_generate.txt" 2>&1 &
    timeout "$limit" python3 -m pytest -q tests/test_core.py > "$d/pytest_core.txt" 2>&1 &
  fi
  wait
  for f in "$d"/pytest_*.txt; do echo "== $(basename "$f")"; tail -4 "$f"; done
}

stage_pallas() {
  local d=$1
  timeout 160 python3 -m pallas_kernels.looped_matmul.smoke --timeout 45 --budget 150 --reps 10 \
    --only splitk_d2048_m1,splitk_d6144_m1,resident_d6144_m1,splitk_d3520_m1,splitk_d12288_m1,splitk_d6144_m8,splitk_d6144_m64,splitk_d6144_m1_regs0,splitk_d6144_m1_leaderpoll,splitk_d6144_m1_ksplit8 \
    > "$d/smoke.log" 2>&1
  sed -n '/=== looped matmul/,$p' "$d/smoke.log"
}

stage_pallas_steps() {
  local d=$1
  timeout 170 python3 -m pallas_kernels.looped_matmul.smoke --suite steps --timeout 40 \
    --budget 160 --reps 10 > "$d/smoke_steps.log" 2>&1
  sed -n '/--- other cases ---/,$p' "$d/smoke_steps.log"
}

stage_pallas_barrier() {
  local d=$1
  timeout 570 python3 -m pallas_kernels.looped_matmul.smoke --suite barrier --timeout 40 \
    --budget 550 --reps 10 --only "${BARRIER_ONLY:-}" > "$d/smoke_barrier.log" 2>&1
  sed -n '/--- other cases ---/,$p' "$d/smoke_barrier.log"
}

stage_pallas_l2() {
  local d=$1 cases=""
  for dim in 2048 3520; do
    for steps in 8 32; do
      cases="$cases,splitk_d${dim}_m1_s${steps},splitk_d${dim}_m1_s${steps}_streamed"
    done
  done
  timeout 200 python3 -m pallas_kernels.looped_matmul.smoke --suite steps --timeout 40 \
    --budget 190 --reps 10 --only "${cases#,}" > "$d/smoke_l2.log" 2>&1
  sed -n '/--- other cases ---/,$p' "$d/smoke_l2.log"
}

stage_chain_nocb() {
  local d=$1
  timeout 200 python3 -m experiments.chain --size=24MiB,8MiB --layouts=shared \
    --impls=torch_graph,pallas_splitk,pallas_splitk_nocb --json_out="$d/chain_nocb.json" \
    --plot_out="$d/chain_nocb.png" > "$d/chain_nocb.txt" 2>&1
  grep -v "chain:" "$d/chain_nocb.txt" | tail -12
}

stage_chain() {
  stage_chain_hbm "$1"
  local d=$1
  timeout 120 python3 -m experiments.chain --size=72MiB --impls=xla,torch_eager,${CHAIN_PALLAS:-pallas,pallas_splitk} \
    --trace_dir="$d/trace" --json_out="$d/chain_trace.json" --plot_out= > "$d/chain_trace.txt" 2>&1
  grep -v "chain:" "$d/chain_trace.txt" | tail -30
}

stage_chain_hbm() {
  local d=$1
  timeout 420 python3 -m experiments.chain --size=72MiB,288MiB,48MiB,24MiB,8MiB \
    --impls=xla_loop,torch_graph,${CHAIN_PALLAS:-pallas,pallas_splitk} --hbm --ncu_timeout=80 \
    --json_out="$d/chain_hbm.json" --plot_out="$d/chain_hbm.png" > "$d/chain_hbm.txt" 2>&1
  grep -v "chain:" "$d/chain_hbm.txt" | tail -45
}

stage_core() {
  local d=$1
  # CORE_ARGS / SWEEP_IMPLS: flags that narrow the main run / the sweep's impls
  # shellcheck disable=SC2086
  timeout 280 python3 -m experiments.core --mode=decode,prefill --iterations=1,8 \
    --impls=xla,xla_cudnn,xla_mgpu,xla_pallas,xla_rows,xla_probe,torch_graph,torch_teaching \
    ${CORE_ARGS:-} \
    --trace_dir="$d/trace" --hlo_dir="$d/hlo" --json_out="$d/core.json" > "$d/core.txt" 2>&1
  stamp "core main done"
  timeout 200 python3 -m experiments.core --mode=decode --iterations=4 --batch=1,8,32 \
    --context=1024,4096 --impls="${SWEEP_IMPLS:-xla,xla_pallas,xla_rows,torch_graph}" \
    --repeats=10 --json_out="$d/core_sweep.json" > "$d/core_sweep.txt" 2>&1
  stamp "core sweep done"
  grep -v "it/s\]" "$d/core.txt" | tail -28; tail -28 "$d/core_sweep.txt"
}

# ncu passes: on 2026-11-30 the Core's (8 children at these defaults) did not finish in 120 s nor
# the adapter's in 45 s; later the adapter's finished within 150 s, and the Core's narrowed to 2
# children (CORE_HBM_ARGS) within 300 s; all 8 at 300 s is untried.
stage_core_hbm() {
  local d=$1
  # shellcheck disable=SC2086  # CORE_HBM_ARGS: flags that narrow the run
  timeout 300 python3 -m experiments.core --mode=decode,prefill --iterations=1,8 \
    --impls=xla,torch_graph --repeats=5 --hbm ${CORE_HBM_ARGS:-} --json_out="$d/core_hbm.json" \
    > "$d/core_hbm.txt" 2>&1
  grep -v "it/s\]" "$d/core_hbm.txt" | tail -12
}

stage_adapter() {
  local d=$1
  timeout 150 python3 -m experiments.adapter --m=1,1024 --hbm --json_out="$d/adapter.json" \
    > "$d/adapter.txt" 2>&1
  tail -8 "$d/adapter.txt"
}

stage_core_xla_gemm() {
  local d=$1
  timeout 80 python3 -m experiments.core --gemm=xla \
    --mode=decode,prefill --iterations=8 --impls=xla,torch_graph --repeats=10 \
    --json_out="$d/core_xla_gemm.json" > "$d/core_xla_gemm.txt" 2>&1
  tail -8 "$d/core_xla_gemm.txt"
}

# XLA flags that may cut the launch gaps between the ~90 kernels of a decode iteration.
CORE_FLAG_VARIANTS=(
  ""
  "--xla_gpu_command_buffer_unroll_loops=true"
  "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
  "--xla_gpu_enable_while_loop_double_buffering=true"
)

stage_core_flags() {
  local d=$1 i=0
  for flags in "${CORE_FLAG_VARIANTS[@]}"; do
    XLA_FLAGS="$flags" timeout 60 python3 -m experiments.core --mode=decode --iterations=8 \
      --impls=xla --repeats=10 --json_out="$d/core_flags_$i.json" > "$d/core_flags_$i.txt" 2>&1
    echo "XLA_FLAGS='$flags': $(grep '^decode' "$d/core_flags_$i.txt")"
    i=$((i + 1))
  done
}

stage_decode_attention() {
  local d=$1
  # shellcheck disable=SC2086  # DA_ARGS: more flags, word-split on purpose
  timeout 240 python3 -m experiments.decode_attention --batch="${DA_BATCH:-1,8}" \
    --context=1024,4096 ${DA_ARGS:-} \
    --json_out="$d/decode_attention.json" > "$d/decode_attention.txt" 2>&1
  tail -20 "$d/decode_attention.txt"
}

stage_gemv() {
  local d=$1
  # shellcheck disable=SC2086  # GEMV_ARGS: more flags, word-split on purpose
  timeout 280 python3 -m pallas_kernels.fused_gemv.tune --budget=250 ${GEMV_ARGS:-} \
    --json_out="$d/gemv_tune.json" > "$d/gemv_tune.txt" 2>&1
  grep -v "^RESULT" "$d/gemv_tune.txt" | tail -12
}

stage_core_rows() {
  local d=$1
  # shellcheck disable=SC2086  # CORE_ROWS_ARGS: flags appended
  timeout 200 python3 -m experiments.core --mode=decode --iterations=1,8 \
    --impls=xla,xla_pallas,xla_rows,torch_graph --trace_dir="$d/trace" --hlo_dir="$d/hlo" \
    ${CORE_ROWS_ARGS:-} --json_out="$d/core_rows.json" > "$d/core_rows.txt" 2>&1
  grep -v "it/s\]" "$d/core_rows.txt" | tail -60
}

stage_core_prefill() {
  local d=$1
  # shellcheck disable=SC2086  # CORE_PREFILL_ARGS: flags appended
  timeout 200 python3 -m experiments.core --mode=prefill --iterations=8 \
    --impls=xla_cudnn,xla_mgpu,torch_graph --repeats=10 --trace_dir="$d/trace" \
    ${CORE_PREFILL_ARGS:-} --json_out="$d/core_prefill.json" > "$d/core_prefill.txt" 2>&1
  grep -v "it/s\]" "$d/core_prefill.txt" | tail -50
}

stage_core_cb() {
  local d=$1 cb trace
  for cb in command_buffers nocommand_buffers; do
    trace=""
    [ "$cb" = nocommand_buffers ] && trace="--trace_dir=$d/trace_$cb"
    timeout 170 python3 -m experiments.core --mode=decode --iterations=1,8 \
      --impls=xla_pallas,xla_rows,torch_graph --"$cb" $trace \
      --json_out="$d/decode_$cb.json" > "$d/decode_$cb.txt" 2>&1
    stamp "decode --$cb done"
    timeout 130 python3 -m experiments.core --mode=prefill --iterations=8 \
      --impls=xla_cudnn,xla_mgpu,torch_graph --repeats=10 --"$cb" $trace \
      --json_out="$d/prefill_$cb.json" > "$d/prefill_$cb.txt" 2>&1
    stamp "prefill --$cb done"
  done
  for f in "$d"/decode_*.txt "$d"/prefill_*.txt; do
    echo "== $(basename "$f")"; grep -E "^(decode|prefill) |traced span|^check|Error" "$f" | tail -12
  done
}

stage_core_clocks() {
  local d=$1 smi
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
    -lms 100 > "$d/smi.csv" &
  smi=$!
  for r in 1 8; do
    echo "$(date +%H:%M:%S.%N) r=$r start" >> "$d/phases.txt"
    timeout 100 python3 -m experiments.core --mode=prefill --iterations=$r --impls=xla_cudnn \
      --repeats=40 --json_out="$d/core_clocks_r$r.json" > "$d/core_clocks_r$r.txt" 2>&1
    echo "$(date +%H:%M:%S.%N) r=$r end" >> "$d/phases.txt"
  done
  kill "$smi"
  cat "$d/phases.txt"; grep -h "^prefill" "$d"/core_clocks_r*.txt
  python3 tools/smi_phases.py "$d/smi.csv" "$d/phases.txt"
}

stage_gemm_clocks() {
  local d=$1 smi
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader \
    -lms 100 > "$d/smi.csv" &
  smi=$!
  timeout 120 python3 tools/gemm_sustained.py --phases="$d/phases.txt" > "$d/gemm.txt" 2>&1
  kill "$smi"
  grep -v "^I1" "$d/gemm.txt"
  python3 tools/smi_phases.py "$d/smi.csv" "$d/phases.txt"
}

stage_hbm_read() {
  local d=$1
  timeout 120 python3 tools/hbm_read.py > "$d/hbm_read.txt" 2>&1
  grep -v "^I1" "$d/hbm_read.txt"
}

stage_prefill_attention() {
  local d=$1
  # shellcheck disable=SC2086  # PA_ARGS: more flags, e.g. --trace_dir=DIR
  timeout 200 python3 -m experiments.prefill_attention --tokens=1024,4096 ${PA_ARGS:-} \
    --json_out="$d/prefill_attention.json" > "$d/prefill_attention.txt" 2>&1
  tail -40 "$d/prefill_attention.txt"
}

stage_generate_mem() {
  local d=$1
  timeout 60 python3 -m huginn_jax.generate --config=huginn_0125 --random_weights --dtype=bf16 \
    --prompt_len=1024 --max_new_tokens=16 --num_steps=32 --cache_len=4096 --init_scale=0 \
    --noprogress --json_out="$d/generate_mem4096.json" > "$d/generate_mem.txt" 2>&1
  tail -16 "$d/generate_mem.txt"
}

stage_generate() {
  local d=$1
  timeout 170 python3 -m experiments.generate_vs_torch --config=huginn_0125 --dtype=bf16 \
    --prompt_len=1024 --max_new_tokens=32 --num_steps=32 \
    --json_out="$d/generate_vs_torch.json" > "$d/generate_vs_torch.txt" 2>&1
  stamp "generate_vs_torch done"
  timeout 120 python3 -m huginn_jax.generate --config=huginn_0125 --random_weights --dtype=bf16 \
    --prompt_len=1024 --max_new_tokens=32 --num_steps=32 --init_scale=0 --breakdown --noprogress \
    --json_out="$d/generate_ctx1024.json" > "$d/generate.txt" 2>&1
  stamp "generate breakdown done"
  timeout 100 python3 -m huginn_jax.generate --config=huginn_0125 --random_weights --dtype=bf16 \
    --prompt_len=1024 --max_new_tokens=16 --num_steps=32 --cache_len=4096 --init_scale=0 \
    --noprogress --json_out="$d/generate_mem4096.json" >> "$d/generate.txt" 2>&1
  tail -15 "$d/generate_vs_torch.txt"; tail -30 "$d/generate.txt"
}

stage_train() {
  local d=$1
  timeout $((${TRAIN_SECONDS:-150} + 200)) python3 -m experiments.train \
    --flagfile=experiments/train_h200.flags --max_train_seconds="${TRAIN_SECONDS:-150}" \
    --json_out="$d/train.json" --plot_out="$d/train.png" \
    --ckpt_dir=/tmp/huginn_train/ckpt --export_dir=/tmp/huginn_train/export > "$d/train.txt" 2>&1
  tail -30 "$d/train.txt"
  # Trained vs random weights of the same shape: Core time and HBM bytes (ncu) per iteration.
  for weights in trained random; do
    timeout 150 python3 -m experiments.core --config=/tmp/huginn_train/export \
      --weights="$weights" --mode=decode,prefill --iterations=32 --context=40 --impls=xla \
      --hbm --hbm_impls=xla --ncu_timeout=60 --json_out="$d/core_$weights.json" \
      > "$d/core_$weights.txt" 2>&1
    echo "core, $weights weights:"; tail -4 "$d/core_$weights.txt"
  done
}

for stage in "$@"; do
  d="$OUT/$stage"
  mkdir -p "$d"
  stamp "stage $stage"
  "stage_$stage" "$d" 2>&1 | tee "$OUT/$stage.txt"
  stamp "stage $stage done"
  # Packed at once: a call cut short still returns the stages it finished.
  tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage" && rm -rf "${OUT:?}/$stage"
done
ls -la "$OUT"
