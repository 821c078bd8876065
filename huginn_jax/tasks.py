"""Synthetic tasks generated in-graph, where more Core iterations should help.

Every task draws a batch from a PRNG key inside `jit` (no host data pipeline, so a training step
is a pure function of its key and resuming replays the same data) and returns a `Batch`:

    tokens     [B, T] int32   the whole sequence, answers included (teacher forcing)
    loss_mask  [B, T] bool    True where tokens[b, t] is an answer token the model must predict
    difficulty [B, T] int32   per answer token: how hard it is (depth, hops, carry chain); else 0

The model reads tokens[:, :-1] and is scored on tokens[:, 1:] where loss_mask[:, 1:] holds. The
answer positions are the same in every sequence of a task (the layout is fixed).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp


class Batch(NamedTuple):
    tokens: jax.Array  # [B, T] int32
    loss_mask: jax.Array  # [B, T] bool
    difficulty: jax.Array  # [B, T] int32


class Task(Protocol):
    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def seq_len(self) -> int: ...

    @property
    def difficulties(self) -> tuple[int, ...]: ...

    def sample(self, key: jax.Array, batch: int) -> Batch: ...

    def label(self, difficulty: int) -> str: ...

    def to_dict(self) -> dict: ...


@dataclasses.dataclass(frozen=True)
class PointerChase:
    """k-hop pointer chasing over a random permutation f of `nodes` symbols.

    Sequence: the N edges "a f(a)" in random order, a separator, then `queries` triples
    "HOP_h x f^h(x)" with h uniform in 1..max_hops. A Core iteration can follow a bounded number of
    edges (one attention lookup per hop), so h hops need iterations that grow with h: accuracy
    against test-time iterations rises, later for larger h.

    Tokens: 0..N-1 nodes, N..N+max_hops-1 the hop counts 1..max_hops, N+max_hops the separator.
    Length T = 2N + 1 + 3·queries.
    """

    nodes: int = 16
    max_hops: int = 8
    queries: int = 4
    name: str = "khop"

    def __post_init__(self):
        if self.nodes < 2 or self.max_hops < 1 or self.queries < 1:
            raise ValueError(
                f"khop needs nodes >= 2, max_hops >= 1, queries >= 1; got nodes={self.nodes}, "
                f"max_hops={self.max_hops}, queries={self.queries}"
            )

    @property
    def vocab_size(self) -> int:
        return self.nodes + self.max_hops + 1

    @property
    def seq_len(self) -> int:
        return 2 * self.nodes + 1 + 3 * self.queries

    @property
    def difficulties(self) -> tuple[int, ...]:
        return tuple(range(1, self.max_hops + 1))

    def sample(self, key: jax.Array, batch: int) -> Batch:
        n, q = self.nodes, self.queries
        k_perm, k_order, k_hops, k_start = jax.random.split(key, 4)
        perm_BxN = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(k_perm, batch))
        order_BxN = jax.vmap(lambda k: jax.random.permutation(k, n))(
            jax.random.split(k_order, batch)
        )
        edges_BxNx2 = jnp.stack([order_BxN, jnp.take_along_axis(perm_BxN, order_BxN, 1)], -1)

        # powers_BxHxN[:, h-1] = f^h, built by composing f with itself max_hops times.
        def compose(power_BxN, _):
            nxt = jnp.take_along_axis(perm_BxN, power_BxN, axis=1)
            return nxt, nxt

        _, powers_HxBxN = jax.lax.scan(
            compose, jnp.broadcast_to(jnp.arange(n), (batch, n)), None, self.max_hops
        )
        hops_BxQ = jax.random.randint(k_hops, (batch, q), 1, self.max_hops + 1)
        start_BxQ = jax.random.randint(k_start, (batch, q), 0, n)
        answer_BxQ = powers_HxBxN[hops_BxQ - 1, jnp.arange(batch)[:, None], start_BxQ]

        sep = jnp.full((batch, 1), n + self.max_hops, jnp.int32)
        queries_BxQx3 = jnp.stack([n + hops_BxQ - 1, start_BxQ, answer_BxQ], -1)
        tokens = jnp.concatenate(
            [edges_BxNx2.reshape(batch, 2 * n), sep, queries_BxQx3.reshape(batch, 3 * q)], axis=1
        ).astype(jnp.int32)
        is_answer_Q3 = jnp.tile(jnp.array([False, False, True]), q)
        loss_mask = jnp.concatenate(
            [jnp.zeros((batch, 2 * n + 1), bool), jnp.broadcast_to(is_answer_Q3, (batch, 3 * q))],
            axis=1,
        )
        hardness = jnp.stack([jnp.zeros_like(hops_BxQ), jnp.zeros_like(hops_BxQ), hops_BxQ], -1)
        difficulty = jnp.concatenate(
            [jnp.zeros((batch, 2 * n + 1), jnp.int32), hardness.reshape(batch, 3 * q)], axis=1
        )
        return Batch(tokens, loss_mask, difficulty.astype(jnp.int32))

    def label(self, difficulty: int) -> str:
        return f"{difficulty} hop{'s' if difficulty > 1 else ''}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ChainRoot:
    """Find the root: `nodes` symbols are cut into random chains; each node points to its
    predecessor and a chain's head (the root) points to itself. Query x, answer root(x).

    Sequence: the N edges in random order, a separator, then `queries` pairs "x root(x)".
    Following one pointer per step reaches the root after depth(x) steps and then stays there
    (the root is a fixed point), so more iterations never hurt and deeper queries need more of
    them. Difficulty of an answer: depth(x) + 1 (1 for a root itself).

    Chain lengths are uniform in 1..max_chain (`uniform_lengths`), else all max_chain (the last
    one cut short). Uniform lengths make shallow queries common, which teach the one-hop step
    that deep queries must repeat, and several roots to choose from, so guessing pays little.

    An edge is one token `N + 1 + a·N + parent(a)` with `edge_tokens` (a Core iteration can follow
    it with one attention lookup), else the two tokens "a parent(a)" (the prelude must first bind
    each parent to the token before it, an induction-head circuit that is slower to learn).

    Tokens: 0..N-1 nodes, N the separator, then the N² edge tokens if used.
    Length T = N·(1 or 2) + 1 + 2·queries.
    """

    nodes: int = 16
    max_chain: int = 8
    queries: int = 4
    edge_tokens: bool = True
    uniform_lengths: bool = True
    name: str = "root"

    def __post_init__(self):
        if self.nodes < 2 or not 1 <= self.max_chain <= self.nodes or self.queries < 1:
            raise ValueError(
                f"root needs nodes >= 2, 1 <= max_chain <= nodes, queries >= 1; got "
                f"nodes={self.nodes}, max_chain={self.max_chain}, queries={self.queries}"
            )

    @property
    def vocab_size(self) -> int:
        return self.nodes + 1 + (self.nodes**2 if self.edge_tokens else 0)

    @property
    def seq_len(self) -> int:
        return self.nodes * (1 if self.edge_tokens else 2) + 1 + 2 * self.queries

    @property
    def difficulties(self) -> tuple[int, ...]:
        return tuple(range(1, self.max_chain + 1))

    def sample(self, key: jax.Array, batch: int) -> Batch:
        n, q = self.nodes, self.queries
        k_perm, k_len, k_order, k_query = jax.random.split(key, 4)
        # Slots 0..N-1 are cut into consecutive chains; slot s holds node perm[s].
        perm_BxN = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(k_perm, batch))
        if self.uniform_lengths:
            lengths_NxB = jax.random.randint(k_len, (n, batch), 1, self.max_chain + 1)
        else:
            lengths_NxB = jnp.full((n, batch), self.max_chain)

        def cut(carry, slot_and_length):
            left_B, root_B, depth_B = carry
            slot, length_B = slot_and_length
            start_B = left_B == 0
            left_B = jnp.where(start_B, length_B, left_B) - 1
            root_B = jnp.where(start_B, slot, root_B)
            depth_B = jnp.where(start_B, 0, depth_B + 1)
            return (left_B, root_B, depth_B), (root_B, depth_B)

        zeros = jnp.zeros((batch,), jnp.int32)
        _, (root_slot_NxB, depth_NxB) = jax.lax.scan(
            cut, (zeros, zeros, zeros), (jnp.arange(n), lengths_NxB)
        )
        root_slot_BxN, depth_BxN = root_slot_NxB.T, depth_NxB.T
        slot_N = jnp.arange(n)
        parent_slot_BxN = jnp.where(depth_BxN == 0, slot_N, slot_N - 1)
        edges_BxNx2 = jnp.stack(
            [perm_BxN, jnp.take_along_axis(perm_BxN, parent_slot_BxN, axis=1)], axis=-1
        )
        order_BxN = jax.vmap(lambda k: jax.random.permutation(k, n))(
            jax.random.split(k_order, batch)
        )
        edges_BxNx2 = jnp.take_along_axis(edges_BxNx2, order_BxN[..., None], axis=1)
        if self.edge_tokens:
            edges = n + 1 + edges_BxNx2[..., 0] * n + edges_BxNx2[..., 1]
        else:
            edges = edges_BxNx2.reshape(batch, 2 * n)
        query_slot_BxQ = jax.random.randint(k_query, (batch, q), 0, n)
        x_BxQ = jnp.take_along_axis(perm_BxN, query_slot_BxQ, axis=1)
        root_BxQ = jnp.take_along_axis(
            perm_BxN, jnp.take_along_axis(root_slot_BxN, query_slot_BxQ, axis=1), axis=1
        )
        sep = jnp.full((batch, 1), n, jnp.int32)
        queries = jnp.stack([x_BxQ, root_BxQ], -1).reshape(batch, 2 * q)
        tokens = jnp.concatenate([edges, sep, queries], axis=1).astype(jnp.int32)
        prompt = jnp.zeros((batch, edges.shape[1] + 1), jnp.int32)
        is_answer = jnp.tile(jnp.array([False, True]), q)
        loss_mask = jnp.concatenate(
            [prompt.astype(bool), jnp.broadcast_to(is_answer, (batch, 2 * q))], axis=1
        )
        hardness_BxQ = jnp.take_along_axis(depth_BxN, query_slot_BxQ, axis=1) + 1
        hardness = jnp.stack([jnp.zeros_like(hardness_BxQ), hardness_BxQ], -1)
        difficulty = jnp.concatenate([prompt, hardness.reshape(batch, 2 * q)], axis=1)
        return Batch(tokens, loss_mask, difficulty.astype(jnp.int32))

    def label(self, difficulty: int) -> str:
        return f"depth {difficulty - 1}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Addition:
    """`digits`-digit addition with the sum written most-significant digit first.

    Sequence: a (MSB first), "+", b, "=", then the digits+1 digits of a + b, MSB first. The leading
    sum digits depend on a carry that can ripple through the whole number, so the first answer
    tokens need the most sequential work. Difficulty of an answer digit: 1 + the length of the
    carry chain that reaches it (1 when no carry comes in).

    Tokens: 0..9 digits, 10 "+", 11 "=". Length T = 3·digits + 3.
    """

    digits: int = 8
    name: str = "add"

    def __post_init__(self):
        if not 1 <= self.digits <= 18:
            raise ValueError(f"add needs 1 <= digits <= 18 (int64 sums); got digits={self.digits}")

    @property
    def vocab_size(self) -> int:
        return 12

    @property
    def seq_len(self) -> int:
        return 3 * self.digits + 3

    @property
    def difficulties(self) -> tuple[int, ...]:
        return tuple(range(1, self.digits + 2))

    def sample(self, key: jax.Array, batch: int) -> Batch:
        d = self.digits
        ka, kb = jax.random.split(key)
        a_BxD = jax.random.randint(ka, (batch, d), 0, 10)  # MSB first
        b_BxD = jax.random.randint(kb, (batch, d), 0, 10)

        # Ripple-carry from the least significant digit; chain[i] = digits the carry into i crossed.
        def add_digit(carry, ab):
            c, chain = carry
            a, b = ab
            total = a + b + c
            out_c = total // 10
            out_chain = jnp.where(out_c > 0, chain + 1, 0)
            return (out_c, out_chain), (total % 10, chain)

        zeros = jnp.zeros((batch,), jnp.int32)
        (top_c, top_chain), (sum_DxB, chain_DxB) = jax.lax.scan(
            add_digit, (zeros, zeros), (a_BxD.T[::-1], b_BxD.T[::-1])
        )
        sum_BxD1 = jnp.concatenate([top_c[:, None], sum_DxB[::-1].T], axis=1)
        chain_BxD1 = jnp.concatenate([top_chain[:, None], chain_DxB[::-1].T], axis=1)
        tokens = jnp.concatenate(
            [a_BxD, jnp.full((batch, 1), 10), b_BxD, jnp.full((batch, 1), 11), sum_BxD1], axis=1
        ).astype(jnp.int32)
        prompt = 2 * d + 2
        loss_mask = jnp.concatenate(
            [jnp.zeros((batch, prompt), bool), jnp.ones((batch, d + 1), bool)], axis=1
        )
        difficulty = jnp.concatenate(
            [jnp.zeros((batch, prompt), jnp.int32), chain_BxD1 + 1], axis=1
        ).astype(jnp.int32)
        return Batch(tokens, loss_mask, difficulty)

    def label(self, difficulty: int) -> str:
        return f"carry chain {difficulty - 1}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


TASKS = {"root": ChainRoot, "khop": PointerChase, "add": Addition}


def make_task(name: str, **kwargs) -> Task:
    """`make_task("root", nodes=16, max_chain=8)`, `make_task("khop", nodes=16, max_hops=8)`,
    `make_task("add", digits=8)`.

    Keyword arguments a task does not take are ignored, so a program can pass all its task flags.
    """
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}") from None
    fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
    return cls(**{k: v for k, v in kwargs.items() if k in fields})


def task_from_dict(d: dict) -> Task:
    """Inverse of `task.to_dict()`."""
    d = dict(d)
    return make_task(d.pop("name"), **d)
