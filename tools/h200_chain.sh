#!/usr/bin/env bash
# One device call: versions, GPU tests, the chain sweep, and its HBM pass. Writes under $OUT.
set -u
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import flax; from flax import nnx; nnx.List" 2>/dev/null || pip install -q --no-deps .wheels/flax-*.whl
python3 -c "import jax, flax, torch; print('jax', jax.__version__, 'flax', flax.__version__, 'torch', torch.__version__, jax.devices())"
timeout 150 python3 -m experiments.chain --size=8MiB,16MiB,24MiB,32MiB,40MiB,48MiB,56MiB,64MiB,72MiB,96MiB,144MiB,288MiB \
  --impls=xla,torch --json_out=$OUT/chain_sweep.json --plot_out=$OUT/chain_sweep.png > $OUT/chain_sweep.txt 2>&1
tail -40 $OUT/chain_sweep.txt
timeout 170 python3 -m experiments.chain --size=8MiB,48MiB,72MiB,288MiB --impls=xla,torch_graph --hbm \
  --json_out=$OUT/chain_hbm.json --plot_out=$OUT/chain_hbm.png > $OUT/chain_hbm.txt 2>&1
tail -25 $OUT/chain_hbm.txt
timeout 60 python3 -m pytest -q -m gpu tests/test_looped_matmul.py -x 2>&1 | tail -15 > $OUT/pytest_gpu.txt; tail -5 $OUT/pytest_gpu.txt
