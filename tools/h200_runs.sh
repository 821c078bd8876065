#!/usr/bin/env bash
# The runs behind results/h200/, in stages; several stages can share one call on the GPU machine:
#
#   bash tools/h200_runs.sh ceilings core chain     # from the repository root, on the H200
#
#   ceilings  the device's measured ceilings (read-only streaming rate, sustained bf16 GEMM rate)
#             -> ceilings.json; every other stage states its floors against it, so run it first
#             (or have results/h200/ceilings.json from an earlier run)
#   tests     every GPU-marked test, and the PyTorch/Core/chain tests whole, in 3 parallel groups
#             (correctness only; TEST_TIMEOUT: seconds per group, default 280)
#   compile_modes  the PyTorch Core through torch.compile in each mode (default, reduce-overhead,
#             max-autotune-no-cudagraphs), decode and prefill: which mode is fastest
#   core      the Core side by side (XLA impls and every PyTorch impl), decode and prefill,
#             r = 8, in $PROCESSES separate processes (default 3) -> core_N.json, then
#             core_headline.{json,txt}: median and range over the processes
#   chain     the chain at 8 ... 288 MiB, every implementation, in $PROCESSES processes, the
#             first with the plot -> chain.{json,txt,png}, chain_headline.{json,txt}
#   chain_trace  where XLA's time per chain goes at 8 MiB: kernels and gaps per chain of each
#             XLA form, against PyTorch's graph
#   adapter, decode_attention, prefill_attention  one process each
#   generate  JAX generation against PyTorch's compiled decode loop, 32 steps per token
#
# Each stage writes under $OUT/STAGE (default out/h200/STAGE) and packs it into $OUT/STAGE.tgz;
# $OUT/STAGE.txt keeps what the stage printed last. Carry `.wheels` (a flax wheel: installed
# only when the machine's flax lacks nnx.List).
set -u
[ $# -ge 1 ] || { echo "usage: $0 STAGE [STAGE...] (see the list above)" >&2; exit 2; }
STAGES="ceilings tests compile_modes core chain chain_trace adapter decode_attention prefill_attention generate"
for stage in "$@"; do
  [[ " $STAGES " == *" $stage "* ]] || { echo "unknown stage $stage; known: $STAGES" >&2; exit 2; }
done
OUT=${OUT:-out/h200}
PROCESSES=${PROCESSES:-3}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. PYTHONUNBUFFERED=1
python3 -c "from flax import nnx; nnx.List" 2>/dev/null || pip install -q --no-deps .wheels/flax-*.whl
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,power.draw --format=csv,noheader
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
CEILINGS=""

stage_ceilings() {
  local d=$1
  timeout 240 python3 -m experiments.ceilings --json_out="$d/ceilings.json" > "$d/ceilings.txt" 2>&1
  tail -8 "$d/ceilings.txt"
}

stage_tests() {
  local d=$1 limit=${TEST_TIMEOUT:-280}
  timeout "$limit" python3 -m pytest -q -m gpu tests/test_looped_matmul.py \
    > "$d/pytest_looped_matmul.txt" 2>&1 &
  timeout "$limit" python3 -m pytest -q tests/test_torch_ref.py tests/test_core.py \
    tests/test_generate_vs_torch.py tests/test_chain.py > "$d/pytest_torch_core_chain.txt" 2>&1 &
  timeout "$limit" python3 -m pytest -q -m gpu --ignore=tests/test_looped_matmul.py \
    --ignore=tests/test_torch_ref.py --ignore=tests/test_core.py \
    --ignore=tests/test_generate_vs_torch.py --ignore=tests/test_chain.py tests \
    > "$d/pytest_other_gpu.txt" 2>&1 &
  wait
  for f in "$d"/pytest_*.txt; do echo "== $(basename "$f"): $(tail -1 "$f")"; done
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

CORE_IMPLS=xla,xla_cudnn,xla_pallas,torch_compile,torch_graph,torch_eager,torch_reference,torch_teaching

stage_core() {
  local d=$1 i
  for i in $(seq 1 "$PROCESSES"); do
    timeout "${CORE_TIMEOUT:-400}" python3 -m experiments.core --mode=decode,prefill --iterations=8 \
      --impls="${CORE_IMPLS_OVERRIDE:-$CORE_IMPLS}" $CEILINGS --json_out="$d/core_$i.json" \
      > "$d/core_$i.txt" 2>&1
    stamp "core process $i rc $?"
  done
  cp "$d/core_1.json" "$d/core.json"; grep -v "it/s\]" "$d/core_1.txt" > "$d/core.txt"
  python3 -m experiments.headline "$d"/core_[0-9]*.json --json_out="$d/core_headline.json" \
    --txt_out="$d/core_headline.txt"
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
  local d=$1
  timeout 500 python3 -m experiments.generate_vs_torch --prompt_len=1024 --max_new_tokens=32 \
    --num_steps=32 --json_out="$d/generate_vs_torch.json" > "$d/generate_vs_torch.txt" 2>&1
  tail -20 "$d/generate_vs_torch.txt"
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
