"""The host side of a run of the paged engine in segments (paged_segments.py's programs):
placing groups in free slots of the batch shards' queues, running segments, reading
finished groups back (`Driver`); sampling/admission.py runs DAPO's dynamic sampling on it.
On several hosts a host fills only its own shards (`local`) and every program runs on every
host at once: the hosts agree before each `push` (the widest prompt, the most groups a
shard takes) and each `collect` (every host's finished rows, read in one program).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.sampling import buckets, paged_mesh
from jaxrl4llm.sampling import page_pool as pages_lib
from jaxrl4llm.sampling import paged_segments as programs
from jaxrl4llm.sampling.row_io import every_host, stop_id_array
from jaxrl4llm.sampling.strategies import SamplingConfig


@dataclasses.dataclass(eq=False)
class Driver:
    """The host side of a run over this host's P slots of G rows, ceil(P / L) on each of the
    L batch shards it fills of the mesh's D (L = D on one host; one shard without a mesh):
    placing groups in free slots, running segments, reading finished groups back. A group
    (admission.py's) has its prompt's tokens `prompt_P` and its rows' keys `keys_G`; `push`
    sets its global `slot` (d * slots + s), `collect` its `rows`."""

    sampler: Any
    sampling: SamplingConfig
    P: int
    G: int
    N: int
    width: int
    max_groups: int

    def __post_init__(self) -> None:
        s, P, G, N = self.sampler, self.P, self.G, self.N
        D = self.D = paged_mesh.shards(s.mesh, s.rules)
        self.mesh = s.mesh if s.mesh is not None and s.mesh.size > 1 else None
        self.local = paged_mesh.local_shards(self.mesh, s.rules, D)  # the shards this host fills
        self.slots, self.rows = programs.shard_layout(P, G, D, len(self.local), s.max_rows or 0)
        self.weights: Any = None
        queue = functools.partial(
            programs.empty_queue, D, self.slots, G, self.width, self.max_groups, N
        )
        self.queue = self._placed(queue(_unused_key()))
        # A mixture of experts' routing record, as the samplers keep it (record_routing).
        self.record = s.record_routing and bool(s.model_config.moe_layers)
        self.program = programs.segment_program(self.sampling, self.mesh, s.rules, **self._run())
        self.num_pages = self._pages(self.width)
        self.order = np.full((D, self.max_groups * G), self.slots * G, np.int32)
        self.free: list[list[int]] = [
            list(range(self.slots)) if d in self.local else [] for d in range(D)
        ]
        self.queued = np.zeros(D, int)
        self.pad_id = np.int32(s.pad_id)
        self.stop_S = jnp.asarray(stop_id_array(s.stop_ids))
        self.state: Any = None

    @property
    def free_slots(self) -> int:
        return sum(map(len, self.free))

    def _placed(self, tree: Any) -> Any:
        """`tree` (a queue, a state, or both) laid out as every segment program takes them
        (paged_segments.run_shardings, by paged_segments.lay_out), so it compiles once."""
        if self.mesh is None:
            return tree
        return programs.lay_out(tree, programs.run_shardings(tree, self.mesh, self.sampler.rules))

    def _pages(self, width: int) -> int:
        """A shard's pool for prompts `width` wide (pages_lib.pool_pages: the sampler's tokens, or
        as many rows as decode at once at full length; at least one group at full length)."""
        tokens = self.sampler.kv_cache_tokens or 0
        return pages_lib.pool_pages(tokens, self.slots * self.G, width, self.N, self.G, self.rows)

    def begin(self, params: Any) -> None:
        s = self.sampler
        self.weights = paged_mesh.decode_weights(params, s.model_config, self.mesh, s.rules)
        self.state = self._placed(
            programs.start(
                self.weights, self.queue, self.pad_id, num_pages=self.num_pages, **self._run()
            )
        )

    def _run(self) -> dict[str, Any]:
        return dict(
            model_config=self.sampler.model_config,
            max_new_tokens=self.N,
            decode_rows=self.rows,
            group=self.G,
            record_routing=self.record,
        )

    def push(self, groups: list[Any]) -> None:
        """Queues `groups` in free slots, each in the shard with the most free slots (the
        prompt width widened first if one needs it)."""
        width = max(
            (
                buckets.bucket_prompt_length(len(g.prompt_P), self.sampler.min_prompt_bucket)
                for g in groups
            ),
            default=0,
        )
        by_shard: list[list[Any]] = [[] for _ in range(self.D)]
        for g in groups:
            d = max(range(self.D), key=lambda d: len(self.free[d]))
            g.slot = d * self.slots + self.free[d].pop(0)
            by_shard[d].append(g)
        # Several hosts run every program together: the widest prompt and the most groups a
        # shard takes, over all hosts (each host queues its own groups in its own shards).
        width, most = every_host([width, max(map(len, by_shard))]).max(axis=0)
        if not most:
            return
        if width > self.width:
            self.num_pages = max(self.num_pages, self._pages(width))
            self.queue, self.state = self._placed(
                programs.widen(
                    self.queue,
                    self.state,
                    self.pad_id,
                    width=width,
                    max_new_tokens=self.N,
                    num_pages=self.num_pages,
                )  # fmt: skip
            )
            self.width = int(width)
        rows, prompt, mask, keys = self._enqueued(by_shard, int(most))
        args: tuple[Any, ...] = (rows, prompt, mask, jax.random.key_data(keys), self.order)
        if jax.process_count() > 1:
            rules = self.sampler.rules
            args = tuple(paged_mesh.from_hosts(x, self.local, self.mesh, rules) for x in args)
        self.queue, self.state = self._placed(
            programs.enqueue(self.queue, self.state, *args, self.pad_id)
        )

    def _enqueued(self, by_shard: list[list[Any]], most: int) -> tuple[Any, ...]:
        """enqueue's rows, prompts, masks and keys [D, K * G, ...] of each shard's new groups
        (K: a power of two >= `most`; padding rows name row R, dropped), their order
        extended."""
        G, D, W, R = self.G, self.D, self.width, self.slots * self.G
        K = 1 << (most - 1).bit_length()
        rows = np.full((D, K * G), R, np.int32)
        prompt = np.full((D, K * G, W), self.pad_id, np.int32)
        mask = np.zeros((D, K * G, W), bool)
        keys = []
        for d, shard in enumerate(by_shard):
            for i, g in enumerate(shard):
                at = slice(i * G, (i + 1) * G)
                rows[d, at] = (g.slot % self.slots) * G + np.arange(G)
                prompt[d, at, W - len(g.prompt_P) :] = g.prompt_P
                mask[d, at, W - len(g.prompt_P) :] = True
                q = self.queued[d]
                self.order[d, q * G : (q + 1) * G] = rows[d, at]
                self.queued[d] += 1
            real = [g.keys_G for g in shard]
            pad = real[:1] or [jax.random.split(_unused_key(), G)]  # rows that do not run
            keys.append(jnp.concatenate(real + pad * (K - len(real))))
        return rows, prompt, mask, jnp.stack(keys)

    def segment(self) -> None:
        self.state = self.program(self.weights, self.queue, self.state, self.stop_S, self.pad_id)

    def collect(self, groups: list[Any]) -> None:
        """Reads back the rows of the `groups` (in flight) whose G rows all finished, and
        frees their slots (global slot d * slots + s: rows slot * G of the shards' rows laid
        end to end). Several hosts call it together, each for its own groups."""
        done, length = (
            np.asarray(x).reshape(-1)
            for x in paged_mesh.host_values((self.state.done_R, self.state.length_R))
        )
        G, finished = self.G, done | (length >= self.N)
        ended = [g for g in groups if finished[g.slot * G : (g.slot + 1) * G].all()]
        most = int(every_host([len(ended)]).max())
        if not most:
            return
        K = 1 << (most - 1).bit_length()
        rows_K = np.zeros((K * G,), np.int32)
        for i, g in enumerate(ended):
            rows_K[i * G : (i + 1) * G] = g.slot * G + np.arange(G)
        every = every_host(rows_K.tolist()).reshape(-1)  # every host's rows, in process order
        R = self.slots * G
        got = paged_mesh.host_values(
            programs.read_rows(self.state, jnp.asarray(every // R), jnp.asarray(every % R))
        )
        mine = slice(jax.process_index() * K * G, (jax.process_index() + 1) * K * G)
        got = {k: np.asarray(v)[mine] for k, v in got.items()}
        for i, g in enumerate(ended):
            at = slice(g.slot * G, (g.slot + 1) * G)
            g.rows = {k: v[i * G : (i + 1) * G] for k, v in got.items()}
            g.rows.update(lengths_G=length[at].copy(), done_G=done[at].copy())
            if self.record:  # the prompt's own columns (its record is left-padded to the width)
                prompt = g.rows["prompt_experts_GPLK"]
                g.rows["prompt_experts_GPLK"] = prompt[:, self.width - len(g.prompt_P) :]
            self.free[g.slot // self.slots].append(g.slot % self.slots)


def _unused_key() -> jax.Array:
    """The key of queue rows no group holds (never drawn from); made when called, since a
    key made at import would start the backend before jax.distributed.initialize."""
    return jax.random.key(0)
