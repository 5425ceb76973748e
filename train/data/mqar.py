"""Multi-query associative recall (MQAR), Zoology's generator (Arora, Eyuboglu et al., 2023).

One example of T = seq_len tokens over a vocabulary of V = vocab_size ids:

    keys    k_1..k_n  distinct, uniform from [1, V/2)        (0 is the filler id, never a key)
    values  v_1..v_n  distinct, uniform from [V/2, V)        (disjoint from the keys)
    tokens  [k_1 v_1 k_2 v_2 ... k_n v_n] repeated num_passes times (JRT), C = 2·n·num_passes,
            then a query region of T − C tokens. Key k_j is queried once, at position
            C + 2·g_j, with distinct gaps g_1..g_n drawn without replacement from
            {0, ..., G − 1}, G = (T − C) // 2, with probability p(g) ∝ a·(g + 1)^(a − 1)
            (power_a = a = 0.01: small gaps, i.e. queries soon after the key-value block, are
            far more likely; a = 1 is uniform).
    filler  every other position holds 0, or with random_non_queries a uniform id from [0, V)
            (which may coincide with a key or value id, as in Zoology).
    targets v_j at the position of the query k_j (the model must output the bound value there);
            IGNORE_INDEX (-100) everywhere else, so loss and accuracy count query positions only.

Zoology's validity checks hold: T even, V > T, 2·n·num_passes + 2·n <= T.
Each example is drawn from its own generator seeded by (seed, index), so example i is the same
whichever order, host or worker reads it. Zoology's test set uses seed + 10.
"""

import dataclasses

import grain
import numpy as np

from train.data.layout import IGNORE_INDEX


def query_gap_probs(space: int, power_a: float) -> np.ndarray:
    """p(g) ∝ a·(g + 1)^(a − 1) over gaps g = 0..space − 1 (Zoology's power law)."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MQARTask:
    """Parameters of the MQAR task (field meanings in the module docstring).

    num_examples: size of the example set (indices 0..num_examples − 1; Zoology trains on
    100,000 and tests on 3,000).
    """

    vocab_size: int = 8192
    seq_len: int = 64
    num_kv_pairs: int = 4
    power_a: float = 0.01
    num_passes: int = 1
    random_non_queries: bool = True
    num_examples: int = 100_000

    def __post_init__(self):
        T, V, n = self.seq_len, self.vocab_size, self.num_kv_pairs
        if T % 2:
            raise ValueError(f"seq_len must be even, got {T}")
        if V <= T:
            raise ValueError(f"vocab_size must exceed seq_len, got vocab_size={V}, seq_len={T}")
        if n < 1 or self.num_passes < 1 or 2 * n * self.num_passes + 2 * n > T:
            raise ValueError("need num_kv_pairs >= 1, num_passes >= 1 and "
                             f"2·num_kv_pairs·num_passes + 2·num_kv_pairs <= seq_len, got "
                             f"num_kv_pairs={n}, num_passes={self.num_passes}, seq_len={T}")
        if n > V // 2 - 1:
            raise ValueError(f"num_kv_pairs={n} exceeds the {V // 2 - 1} key ids of vocab_size={V}")
        if not self.power_a > 0:
            raise ValueError(f"power_a must be > 0, got {self.power_a}")
        if self.num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {self.num_examples}")

    @property
    def context_size(self) -> int:
        """C: tokens of the key-value block(s) at the start."""
        return 2 * self.num_kv_pairs * self.num_passes

    def example(self, seed: int, index: int) -> dict:
        """Example ``index`` of the set drawn with ``seed``: ``inputs`` and ``targets``, int32 [T]."""
        T, V, n, C = self.seq_len, self.vocab_size, self.num_kv_pairs, self.context_size
        rng = np.random.default_rng([seed, index])
        keys = 1 + rng.choice(V // 2 - 1, n, replace=False)
        values = V // 2 + rng.choice(V - V // 2, n, replace=False)
        space = (T - C) // 2
        gaps = rng.choice(space, n, replace=False, p=query_gap_probs(space, self.power_a))
        inputs = np.zeros(T, np.int32)
        inputs[:C] = np.tile(np.stack([keys, values], 1).reshape(-1), self.num_passes)
        query = C + 2 * gaps
        inputs[query] = keys
        targets = np.full(T, IGNORE_INDEX, np.int32)
        targets[query] = values
        if self.random_non_queries:
            filler = inputs == 0
            inputs[filler] = rng.integers(V, size=int(filler.sum()))
        return {"inputs": inputs, "targets": targets}

    def source(self, seed: int) -> grain.MapDataset:
        """The example set: element i is one row, ``example(seed, i)``."""
        return grain.MapDataset.range(self.num_examples).map(_MQARRow(self, seed))

    def rows(self, examples: grain.MapDataset, batch_size: int,
             read_options: grain.ReadOptions) -> grain.IterDataset:
        """Batches of ``inputs`` and ``targets`` [B, T]: one example per row, so no document
        boundaries (``train.data.layout``)."""
        return examples.batch(batch_size, drop_remainder=True).to_iter_dataset(read_options)


@dataclasses.dataclass(frozen=True)
class _MQARRow:
    """Example index -> its row, ``task.example(seed, index)``."""

    task: MQARTask
    seed: int

    def __call__(self, index) -> dict:
        return self.task.example(self.seed, int(index))
