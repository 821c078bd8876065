"""The training program (`python -m experiments.train`; its usage is in `__main__`).

Modules: `options` (flags, their check, `Options`), `loop` (the training run, checkpoints,
resume), `compare` (trained vs random), `report` (plot and table from the JSON), `__main__`
(the program: evaluation, export and the results JSON around them). The model, the recipe, the
evaluation and the tasks are library code in `huginn_jax.train`, `huginn_jax.evaluation` and
`huginn_jax.tasks`.
"""
