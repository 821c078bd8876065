"""Generation: a prefill, then one compiled step per token, with adaptive exit, sampling, cache
strategies and continuous thought; and a command line (`python -m huginn_jax.generate --help`).

Modules, each importing only those before it: `exits` (criteria and exit bookkeeping),
`sampling`, `step` (one token, compiled), `plan` (`make_plan`: a checked request), `stats`
(bytes, memory, per-part timing), `loop` (`run_plan`, `generate`), `options` (the command
line's flags and their checks), `cli`.

Each token is ONE compiled call of `step`: prelude → Core iterations (a `lax.scan` for a fixed
count, a `lax.while_loop` with per-sequence exit checks for a criterion) → coda → sampling. The
cache is donated, so every write is in place. The Python loop over tokens only dispatches and
waits (to time each token).

Shape letters: B batch, T positions of a step (the prompt for the prefill, 1 for a decode step),
D model width, V vocabulary, M most recurrence steps per token, N new tokens.

Adaptive exit (the reference's `generate_with_adaptive_compute`, per token): after every Core
iteration the criterion is evaluated on the last position; a sequence exits at the first step
where it holds (and at least `min_steps` steps ran), else after `num_steps`. In a batch each
sequence exits on its own: finished ones keep their state, logits and cache entries while the
others run on, and the loop ends when all have exited.
"""

from huginn_jax.generate.exits import CRITERIA, Criterion, ExitState, exit_schedule
from huginn_jax.generate.loop import Generation, generate, greedy, run_plan
from huginn_jax.generate.plan import Plan, make_plan
from huginn_jax.generate.sampling import sample_token
from huginn_jax.generate.stats import decode_step_bytes, peak_memory_bytes, time_parts
from huginn_jax.generate.step import StepOutput, StepSpec, step

__all__ = [
    "CRITERIA",
    "Criterion",
    "ExitState",
    "Generation",
    "Plan",
    "StepOutput",
    "StepSpec",
    "decode_step_bytes",
    "exit_schedule",
    "generate",
    "greedy",
    "make_plan",
    "peak_memory_bytes",
    "run_plan",
    "sample_token",
    "step",
    "time_parts",
]
