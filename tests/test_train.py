"""Training: the recurrence sampler, truncated backprop, one compile for every depth, evaluation,
export and resume; on a model small enough for CPU (1 prelude, 2 Core, 1 coda layer, width 32)."""

import collections
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from program_runs import run_forked

import huginn_jax
from huginn_jax import evaluation, tasks, train
from huginn_jax.config import HuginnConfig
from huginn_jax.model import embed, initial_state, run_coda, run_prelude
from huginn_jax.orbax_checkpoint import TrainCheckpoints

CFG = HuginnConfig(
    n_embd=32,
    n_heads=2,
    intermediate_size=48,
    vocab_size=48,
    block_size=32,
    n_layers_in_prelude=1,
    n_layers_in_recurrent_block=2,
    n_layers_in_coda=1,
    mean_recurrence=4,
)
TASK = tasks.make_task("root", nodes=6, max_chain=3, queries=3)  # vocab 43 with edge tokens
TCFG = train.TrainConfig(
    batch=32, lr=3e-3, warmup_steps=5, mean_recurrence=3.0, backprop_depth=2, weight_decay=0.0
)


@pytest.fixture(scope="module")
def setup():
    tx = train.make_optimizer(TCFG)
    graphdef, state = train.init_train_state(train.run_config(CFG, TCFG), tx, seed=0)
    step_fn = train.make_train_step(graphdef, TASK, tx, TCFG)
    return graphdef, state, step_fn, tx


def _copy(tree):
    return jax.tree.map(jnp.array, tree)  # fresh buffers: step_fn donates its argument


def _run(step_fn, state, n, depths=None):
    losses = []
    for _ in range(n):
        state, metrics = step_fn(state)
        losses.append(float(metrics["loss"]))
        if depths is not None:
            depths.append(int(metrics["n_nograd"] + metrics["n_grad"]))
    return state, losses


@pytest.fixture(scope="module")
def trained(setup):
    """40 steps from the fixture's initial state: (state, losses, depths, n_compiled)."""
    _, state, step_fn, _ = setup
    depths = []
    state, losses = _run(step_fn, _copy(state), 40, depths)
    return state, losses, depths, step_fn._cache_size()


def test_sampler_statistics():
    mean, k, sigma = 32.0, 8, 0.5
    keys = jax.random.split(jax.random.key(0), 40_000)
    n_nograd, n_grad = jax.vmap(lambda key: train.sample_recurrence(key, mean, k, sigma))(keys)
    n_nograd, n_grad = np.asarray(n_nograd), np.asarray(n_grad)
    p = n_nograd + n_grad
    assert p.min() >= 1
    np.testing.assert_array_equal(n_grad, np.minimum(p, k))
    np.testing.assert_array_equal(n_nograd, np.maximum(p - k, 0))
    # E[p] = E[τ] + 1; Var[p] = E[τ] + Var[τ] (Poisson mixed over a log-normal rate).
    assert abs(p.mean() - (mean + 1)) < 0.01 * (mean + 1), p.mean()
    var = mean + mean**2 * (np.exp(sigma**2) - 1)
    assert abs(p.var() - var) < 0.08 * var, (p.var(), var)


@functools.cache
def _pieces(seed=1):
    """A random model, a batch, its prelude output, a random s0 and the Core's (graphdef, params);
    computed under jit (eager dispatch of every op takes seconds)."""
    graphdef, params = train.init_params(CFG, jax.random.key(seed))
    model = train.merge_model(graphdef, params)
    batch = jax.jit(TASK.sample, static_argnums=1)(jax.random.key(seed + 1), 4)
    ids = batch.tokens[:, :-1]

    @jax.jit
    def prelude_and_s0(params, ids, key):
        m = train.merge_model(graphdef, params)
        embedded, _ = run_prelude(m, embed(m, ids), jnp.int32(0), None)
        return embedded, initial_state(CFG, ids.shape, init_scale=1.0, key=key, dtype=jnp.float32)

    embedded, s0 = prelude_and_s0(params, ids, jax.random.key(seed + 2))
    core_graphdef, core_params = train.split_core(model)
    return model, batch, embedded, s0, core_graphdef, core_params


def test_gradient_is_exactly_zero_before_the_last_k():
    """A perturbation of the state before the last k of p iterations has exactly zero gradient;
    one at the start of, or inside, the last k has a non-zero gradient."""
    model, batch, embedded, s0, gd, cp = _pieces()
    p, k = 6, 2

    def loss_of(state):
        logits, _, _ = run_coda(model, state, jnp.int32(0), None)
        return train.answer_loss(logits, batch.tokens[:, 1:], batch.loss_mask[:, 1:])[0]

    @jax.jit
    @jax.grad
    def grad_before(delta, at):  # inject after `at` < p − k no-grad iterations
        state = train.run_nograd(gd, cp, s0, embedded, at) + delta
        state = train.run_nograd(gd, cp, state, embedded, p - k - at)
        return loss_of(train.run_grad(gd, cp, state, embedded, jnp.int32(k), k))

    @jax.jit
    @jax.grad
    def grad_within(delta, at):  # inject after `at` >= p − k iterations
        state = train.run_nograd(gd, cp, s0, embedded, jnp.int32(p - k))
        state = train.run_grad(gd, cp, state, embedded, at - (p - k), k) + delta
        return loss_of(train.run_grad(gd, cp, state, embedded, p - at, k))

    delta = jnp.zeros_like(s0)
    for at in range(p):
        if at < p - k:
            g = np.asarray(grad_before(delta, jnp.int32(at)))
            assert not g.any(), f"gradient reaches iteration {at} (before the last {k})"
        else:
            g = np.asarray(grad_within(delta, jnp.int32(at)))
            assert np.abs(g).max() > 1e-6, f"no gradient at iteration {at} (one of the last {k})"


def test_truncated_forward_equals_the_model():
    """n_nograd + n_grad iterations (scan of max_k with trailing no-ops) = model(num_steps=p)."""
    model, batch, embedded, s0, gd, cp = _pieces()
    ref = model(batch.tokens[:, :-1], num_steps=5, init_state=s0).logits

    @jax.jit
    def truncated(s0, embedded):
        state = train.run_nograd(gd, cp, s0, embedded, jnp.int32(3))
        exact = train.run_grad(gd, cp, state, embedded, jnp.int32(2), 2)
        padded = train.run_grad(gd, cp, state, embedded, jnp.int32(2), 6)
        return exact, padded, run_coda(model, padded, jnp.int32(0), None)[0]

    exact, padded, logits = truncated(s0, embedded)
    np.testing.assert_array_equal(exact, padded)  # iterations past n_grad change nothing
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def test_loss_falls_with_one_compile(trained):
    _, losses, depths, compiled = trained
    assert np.all(np.isfinite(losses))
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < first - 0.5, (first, last)
    assert len(set(depths)) >= 4 and min(depths) <= 2  # p varied, below k too
    assert compiled == 1  # every sampled depth ran in the same executable


def test_evaluate_matches_model_calls(trained, setup):
    graphdef = setup[0]
    model = train.merge_model(graphdef, trained[0].params)
    result = evaluation.evaluate(
        model, TASK, jax.random.key(5), iterations=[1, 3], num_examples=8, batch=8, init_scale=0.0
    )
    data = TASK.sample(jax.random.split(jax.random.fold_in(jax.random.key(5), 0))[0], 8)
    mask = np.asarray(data.loss_mask[:, 1:])
    for i, r in enumerate([1, 3]):
        logits = model(data.tokens[:, :-1], num_steps=r, init_scale=0.0).logits
        correct = np.asarray(logits.argmax(-1) == data.tokens[:, 1:])[mask]
        assert result["accuracy"][i] == pytest.approx(correct.mean())
    assert set(result["by_difficulty"]) <= {"1", "2", "3"}  # depth + 1 in chains of 3
    exits = result["adaptive_exit"]
    assert 2 <= exits["mean_exit"] <= 3 and sum(exits["exit_histogram"]) == 8 * TASK.queries


def test_export_reproduces_trained_logits(trained, setup, tmp_path):
    model = train.merge_model(setup[0], trained[0].params)
    huginn_jax.save_pretrained(model, tmp_path / "export")
    loaded = huginn_jax.from_pretrained(tmp_path / "export")
    ids = TASK.sample(jax.random.key(9), 8).tokens[:, :-1]
    a = model(ids, num_steps=3, init_scale=0.0).logits
    b = loaded(ids, num_steps=3, init_scale=0.0).logits
    np.testing.assert_array_equal(a, b)


def test_resume_equals_uninterrupted_run(setup, trained, tmp_path):
    """6 steps straight vs 3 steps, save, restore into fresh buffers from disk, 3 more."""
    _, state0, step_fn, _ = setup
    straight, losses = _run(step_fn, _copy(state0), 6)

    half, first = _run(step_fn, _copy(state0), 3)
    ckpt = TrainCheckpoints(tmp_path / "ckpt", max_to_keep=2, save_interval_steps=3)
    assert ckpt.save(3, half._asdict(), {"run": "test"})
    ckpt.close()
    del half
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state0._asdict())
    step, tree, meta = TrainCheckpoints(tmp_path / "ckpt").restore_latest(abstract)
    assert step == 3 and meta["run"] == "test"
    resumed, second = _run(step_fn, train.TrainState(**tree), 3)
    assert first + second == losses  # bit-exact
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_addition_task_is_correct():
    task = tasks.make_task("add", digits=5)
    b = task.sample(jax.random.key(0), 64)
    tokens = np.asarray(b.tokens)
    for row in tokens:
        a = int("".join(map(str, row[:5])))
        c = int("".join(map(str, row[6:11])))
        assert row[5] == 10 and row[11] == 11
        assert int("".join(map(str, row[12:]))) == a + c
    assert np.asarray(b.loss_mask)[:, 12:].all() and not np.asarray(b.loss_mask)[:, :12].any()


@pytest.mark.parametrize("edge_tokens, uniform", [(True, True), (False, False)])
def test_root_answers_are_the_chain_heads(edge_tokens, uniform):
    task = tasks.make_task(
        "root", nodes=7, max_chain=3, queries=3, edge_tokens=edge_tokens, uniform_lengths=uniform
    )
    b = jax.jit(task.sample, static_argnums=1)(jax.random.key(4), 16)
    n = task.nodes
    assert b.tokens.shape == (16, task.seq_len) and int(b.tokens.max()) < task.vocab_size
    for row, diff in zip(np.asarray(b.tokens), np.asarray(b.difficulty), strict=True):
        if edge_tokens:
            pairs = [divmod(int(t) - n - 1, n) for t in row[:n]]
        else:
            pairs = list(zip(row[0 : 2 * n : 2], row[1 : 2 * n : 2], strict=True))
        parent = dict(pairs)
        assert sorted(parent) == list(range(n))
        queries = row[len(row) - 2 * task.queries :]
        for q in range(task.queries):
            x, answer = queries[2 * q], queries[2 * q + 1]
            depth = 0
            while parent[x] != x:
                x, depth = parent[x], depth + 1
            assert x == answer and diff[len(row) - 2 * task.queries + 2 * q + 1] == depth + 1
        chain_lengths = collections.Counter(_root(parent, a) for a in parent).values()
        assert max(chain_lengths) <= task.max_chain
        if not uniform:  # all full length but the last
            assert sorted(chain_lengths)[1:] == [task.max_chain] * (len(chain_lengths) - 1)


def _root(parent, x):
    while parent[x] != x:
        x = parent[x]
    return x


def test_khop_answers_follow_the_edges():
    task = tasks.make_task("khop", nodes=4, max_hops=3, queries=2)
    b = jax.jit(task.sample, static_argnums=1)(jax.random.key(3), 16)
    n, h = task.nodes, task.max_hops
    for row in np.asarray(b.tokens):
        f = dict(zip(row[0 : 2 * n : 2], row[1 : 2 * n : 2], strict=True))
        assert sorted(f) == list(range(n)) and sorted(f.values()) == list(range(n))
        for q in range(task.queries):
            hop_tok, x, y = row[2 * n + 1 + 3 * q : 2 * n + 4 + 3 * q]
            for _ in range(hop_tok - n + 1):
                x = f[x]
            assert x == y and 1 <= hop_tok - n + 1 <= h


def test_layers_flag_sets_the_depth_and_its_init():
    from absl import flags

    from experiments.train import options as train_exp

    fv = flags.FlagValues()  # the program defines its flags only when it runs
    train_exp.define_flags(fv)
    fv(
        [
            "train",
            "--config=micro",
            "--task=add",
            "--digits=2",
            "--layers=1,3,2",
            "--mean_recurrence=4",
        ]
    )
    config, _, _ = train_exp.setup_from_flags(fv)
    assert (config.n_layers_in_prelude, config.n_core, config.n_layers_in_coda) == (1, 3, 2)
    assert config.effective_expected_depth == 1 + 2 + 3 * 4  # recomputed, not the preset's


def test_bad_flag_is_one_line_and_exit_2():
    for args in (
        ["--config=nope"],
        ["--eval_iterations=1,x"],
        ["--layers=1,0,1"],
        ["--layers=2,2"],
        ["--steps=0"],
    ):
        proc = run_forked("experiments.train", *args, cwd=Path(__file__).parents[1])
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("train: ")


def test_time_limit_stops_within_a_few_steps():
    """The loop checks the clock after every step, not only at log points: it stops at the
    first step that ends past the time limit, however long the steps take."""
    import time

    from experiments.train import loop as train_exp

    State = collections.namedtuple("State", "step")
    one = jnp.float32(1.0)
    metrics = dict(loss=one, accuracy=one, grad_norm=one, n_nograd=one, n_grad=one, lr=one)
    starts, ends = [], []

    def slow_step(state):
        starts.append(time.perf_counter())
        time.sleep(0.05)
        ends.append(time.perf_counter())
        return State(state.step + 1), metrics

    limit = 0.5
    called = time.perf_counter()
    state, history, timing = train_exp.train_loop(
        slow_step,
        State(jnp.int32(0)),
        steps=1000,
        tokens_per_step=1,
        log_every=500,
        ckpt=None,
        meta={},
        history=[],
        max_seconds=limit,
    )
    returned = time.perf_counter()
    stopped = timing["stopped_by_time_limit_at_step"]
    assert stopped == len(ends) == int(state.step)
    assert history and history[-1]["step"] == stopped
    assert returned - called > limit  # not before the limit
    # Every step but the last ended within the limit (counted from the first step's start, no
    # earlier than the loop's clock starts): a loop that checked only at log points would run
    # hundreds of steps past it.
    assert all(end - starts[0] <= limit for end in ends[:-1]), (starts[0], ends)


def _options(*args):
    from absl import flags

    from experiments.train import options

    fv = flags.FlagValues()
    options.define_flags(fv)
    fv(["train", "--config=micro", "--task=add", "--digits=2", *args])
    return options.options_from_flags(fv)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps=0"], "--steps must be >= 1, got 0"),
        (["--max_train_seconds=-5"], r"--max_train_seconds must be a number >= 0 \(0: no limit\)"),
        (["--kl_threshold=0"], "--kl_threshold must be a number > 0"),
        (["--eval_init_scale=nan"], "--eval_init_scale must be a number >= 0"),
        (["--seed=-1"], "--seed must be >= 0"),
        (["--weight_decay=nan"], "weight_decay=nan must be a number >= 0"),
    ],
)
def test_bad_values_are_refused_before_training(args, message):
    from experiments.program import UserError

    with pytest.raises(UserError, match=message):
        _options(*args)


def test_what_is_not_saved_is_said_first(tmp_path):
    assert _options().paths.unsaved().startswith("no --out_dir: nothing will be saved")
    assert _options(f"--out_dir={tmp_path}").paths.unsaved() is None
    partial = _options(f"--out_dir={tmp_path}", "--export_dir=", "--plot_out=")
    assert partial.paths.unsaved() == "this run will not save: plot, trained weights"


def test_resume_with_only_damaged_checkpoints_is_an_error(tmp_path):
    """--resume never turns every checkpoint being damaged into a silent restart at step 0."""
    from experiments.train import loop
    from huginn_jax.files import CheckpointError

    ckpt = TrainCheckpoints(tmp_path / "ckpt")
    ckpt.save(5, {"x": np.zeros(2, np.float32)}, {})
    ckpt.close()
    (tmp_path / "ckpt" / "5" / "meta").rename(tmp_path / "ckpt" / "5" / "gone")
    opts = _options(f"--out_dir={tmp_path}", "--resume", "--steps=10", "--layers=1,1,1")
    notes = []
    with pytest.raises(CheckpointError, match="every checkpoint is damaged"):
        loop.run_training(opts, notes.append)
    assert len(notes) == 1 and "step 5 is damaged" in notes[0]


def test_progress_rate_leaves_out_the_compiled_first_step(capsys):
    """The bar (its rate, hence its ETA) starts after the first step, which compiles."""
    import re
    import time

    from experiments.train import loop as train_exp

    State = collections.namedtuple("State", "step")

    def step(state):
        time.sleep(1.0 if int(state.step) == 0 else 0.005)  # a slow "compile", then fast steps
        one = jnp.float32(1.0)
        metrics = dict(loss=one, accuracy=one, grad_norm=one, n_nograd=one, n_grad=one, lr=one)
        return State(state.step + 1), metrics

    train_exp.train_loop(
        step, State(jnp.int32(0)), steps=20, tokens_per_step=1, log_every=100, ckpt=None,
        meta={}, history=[],
    )  # fmt: skip
    err = capsys.readouterr().err
    assert "compiling the training step (step 1)" in err
    rate = float(re.findall(r"([\d.]+)step/s", err)[-1])
    assert rate > 30, err  # counting the first step, 20 steps would take over 1 s: < 20 step/s
