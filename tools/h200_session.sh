#!/usr/bin/env bash
# Device runs for the open issues, in stages that each fit one device call (10 min limit):
#
#   bash tools/h200_session.sh pallas     # issue 4: both kernel variants against XLA, one table
#   bash tools/h200_session.sh tests      # GPU-only tests (pallas kernel, traces, torch reference)
#   bash tools/h200_session.sh chain      # issue 3 + 4: sweep with pallas, HBM at 8/48/72/288 MiB
#   bash tools/h200_session.sh core       # issue 5: Core decode/prefill, sweeps, adapter, traces, HLO
#   bash tools/h200_session.sh core_hbm   # issue 5: HBM bytes per Core iteration (ncu)
#   bash tools/h200_session.sh generate   # issue 6: per-token latency and peak memory
#   bash tools/h200_session.sh generate_torch  # issue 6: the same weights in a PyTorch loop
#   bash tools/h200_session.sh train      # issue 7: training run and the accuracy curve
#
# Run from the repository root on the H200 machine (its own python3 with jax 0.11.2 and torch);
# carry `.wheels` (made here with `pip download --no-deps -d .wheels flax==0.12.12`; installed
# there only if the image's flax, 0.12.10 on 2026-11-30, lacks nnx.List).
# Everything is written under $OUT (at most 8 files come back: traces and HLO are tarred).
set -u
stage=${1:?stage: pallas, tests, chain, core, core_hbm, generate, generate_torch or train}
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
python3 -c "from flax import nnx; nnx.List" 2>/dev/null || pip install -q --no-deps .wheels/flax-*.whl
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader

case "$stage" in
pallas)
  timeout 570 python3 -m pallas_kernels.looped_matmul.smoke --budget 540 > "$OUT/smoke.log" 2>&1
  tail -c 6000 "$OUT/smoke.log"
  ;;
tests)
  timeout 500 python3 -m pytest -q -m gpu tests/ 2>&1 | tail -30 | tee "$OUT/pytest_gpu.txt"
  ;;
chain)
  timeout 200 python3 -m experiments.chain \
    --size=8MiB,16MiB,24MiB,32MiB,40MiB,48MiB,56MiB,64MiB,72MiB,96MiB,144MiB,288MiB \
    --impls=xla,torch,pallas --json_out="$OUT/chain_sweep.json" --plot_out="$OUT/chain_sweep.png" \
    > "$OUT/chain_sweep.txt" 2>&1
  timeout 360 python3 -m experiments.chain --size=8MiB,48MiB,72MiB,288MiB \
    --impls=xla_loop,torch_graph,pallas --hbm --trace_dir="$OUT/trace" \
    --json_out="$OUT/chain_hbm.json" --plot_out="$OUT/chain_hbm.png" > "$OUT/chain_hbm.txt" 2>&1
  tar czf "$OUT/chain_traces.tgz" -C "$OUT" trace 2>/dev/null && rm -rf "$OUT/trace"
  grep -v "chain:" "$OUT/chain_sweep.txt" | tail -5; grep -v "chain:" "$OUT/chain_hbm.txt" | tail -30
  ;;
core)
  timeout 330 python3 -m experiments.core --mode=decode,prefill --iterations=1,8 \
    --impls=xla,xla_cudnn,torch --trace_dir="$OUT/trace" --hlo_dir="$OUT/hlo" \
    --json_out="$OUT/core.json" > "$OUT/core.txt" 2>&1
  timeout 120 python3 -m experiments.core --mode=decode --iterations=8 --batch=1,8,32 \
    --context=1024,4096 --impls=xla,torch_graph --repeats=10 --json_out="$OUT/core_sweep.json" \
    > "$OUT/core_sweep.txt" 2>&1
  timeout 100 python3 -m experiments.adapter --m=1,1024 --hbm --json_out="$OUT/adapter.json" \
    > "$OUT/adapter.txt" 2>&1
  tar czf "$OUT/core_traces_hlo.tgz" -C "$OUT" trace hlo 2>/dev/null && rm -rf "$OUT/trace" "$OUT/hlo"
  tail -25 "$OUT/core.txt"; tail -12 "$OUT/core_sweep.txt"; tail -8 "$OUT/adapter.txt"
  ;;
core_hbm)
  timeout 560 python3 -m experiments.core --mode=decode,prefill --iterations=1,8 \
    --impls=xla,torch_graph --repeats=5 --hbm --json_out="$OUT/core_hbm.json" \
    > "$OUT/core_hbm.txt" 2>&1
  tail -20 "$OUT/core_hbm.txt"
  ;;
generate)
  timeout 250 python3 -m huginn_jax.generate --config=huginn_0125 --random_weights --dtype=bf16 \
    --prompt_len=1024 --max_new_tokens=64 --num_steps=32 --init_scale=0 --breakdown --noprogress \
    --json_out="$OUT/generate_ctx1024.json" > "$OUT/generate.txt" 2>&1
  timeout 150 python3 -m huginn_jax.generate --config=huginn_0125 --random_weights --dtype=bf16 \
    --prompt_len=1024 --max_new_tokens=16 --num_steps=32 --cache_len=4096 --init_scale=0 \
    --noprogress --json_out="$OUT/generate_mem4096.json" >> "$OUT/generate.txt" 2>&1
  tail -30 "$OUT/generate.txt"
  ;;
generate_torch)
  timeout 150 python3 -m pytest -q tests/test_torch_ref.py 2>&1 | tail -15 | tee "$OUT/pytest_torch_ref.txt"
  timeout 400 python3 -m experiments.generate_vs_torch --config=huginn_0125 --dtype=bf16 \
    --prompt_len=1024 --max_new_tokens=32 --num_steps=32 --torch_eager \
    --json_out="$OUT/generate_vs_torch.json" > "$OUT/generate_vs_torch.txt" 2>&1
  tail -15 "$OUT/generate_vs_torch.txt"
  ;;
train)
  timeout 540 python3 -m experiments.train --flagfile=experiments/train_h200.flags \
    --json_out="$OUT/train.json" --plot_out="$OUT/train.png" \
    --ckpt_dir=/tmp/huginn_train/ckpt --export_dir=/tmp/huginn_train/export > "$OUT/train.txt" 2>&1
  tail -30 "$OUT/train.txt"
  ;;
*)
  echo "unknown stage $stage" >&2; exit 2
  ;;
esac
