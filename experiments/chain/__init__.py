"""experiments.chain: shared weights against copies in a chain of dependent products.

Run it as `python -m experiments.chain` (`__main__`: the program's doc and entry). Modules, in
the order the data flows:

  options   flags -> validated `Options`: sizes -> d, impl names, CPU timing, memory check
  runners   weights in a layout, and one prepared `Runner` per XLA / Pallas implementation
            (the PyTorch side: experiments.torch_ref.chain)
  passes    a Runner timed, traced, or run inside an ncu profiler range
  children  the child processes (`--child=timing|ncu|trace`) and how the parent runs them
  sweep     every size x layout x impl into the results dict the JSON holds
  report    checks, "vs best", the table, the failure lines, the traces' summaries
"""
