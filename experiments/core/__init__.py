"""experiments.core: the Core alone at huginn-0125 size, r iterations per call, against PyTorch.

Run it as `python -m experiments.core` (`__main__`: the program's doc, flags and entry). Modules,
in the order the data flows:

  cases      flags -> the cases (`Case`) and impl names; the Core's config
  runners    weights, a case's inputs, the jitted Core and its XLA runner, one runner per impl
             (the PyTorch side: experiments.torch_ref.core_runner)
  sweep      every case x impl timed into the results dict the JSON holds
  report     the cost model of a case, one record, agreement checks, the table and report lines
  profiling  per-kernel traces, and the Nsight Compute pass with its child (`--ncu_child`)
"""

import os

# PyTorch runs in the same process: JAX must not grab 75 % of the GPU up front. Set here, before
# any module of the package imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
