"""Weighted corpus mixtures: ``--data 0.7 web/ 0.2 code/ 0.1 math.jsonl`` (Megatron-LM's ``--data-path`` syntax).

Each source is its own token store (tokenized once, cached, or a token store / Megatron dataset given as is) and its
own packed dataset; `MixtureLoader` draws the global sample sequence from them.

Blending (`Blend`). Weights are normalized to sum to 1 and kept as exact fractions. Global sample n + 1 goes to a
source chosen from the counts so far: Megatron-LM's blending (helpers.cpp ``build_blending_indices``) gives it to
the source most behind its target ``w * n``, which keeps every prefix close to the weights but not within one
sample for every set of weights (with 0.05 / 0.05 / 0.9 a prefix is 1.2 samples off). We use the refinement that
is proven to stay within one sample, Tijdeman's solution of the chairman assignment problem (R. Tijdeman, "The
chairman assignment problem", Discrete Mathematics 32, 1980): among the sources at least ``d = 1 / (2k - 2)``
behind their target after this sample (``w_j (n + 1) - c_j >= d``), take the one whose next sample is due first
(smallest ``(c_j + 1 - d) / w_j``; ties to the earlier source). Then for every prefix of every length n and every
source,

    | c_j(n) - w_j n |  <=  1 - 1 / (2k - 2)        (k >= 2 sources; 1/2 for two, 3/4 for three)

so each source's share of any prefix is within one sample of its weight (the acceptance bound; tests check it for
random weights and show Megatron's rule failing it). The arithmetic is on integers (exact fractions), so the
sequence is the same on every machine. It depends on nothing but the weights: not on the seed, the data-parallel
size or any other layout.

Order within a source. Source j's c-th sample is sample ``perm[c mod n_j]`` of its epoch ``c // n_j``, ``perm`` =
``default_rng([seed, j, epoch]).permutation(n_j)``: a small source starts a new, differently shuffled epoch when it
is exhausted, independently of the others.

Data parallelism, state. Global micro-batches of ``micro_batch_size * dp_size`` consecutive global samples; rank r
takes slice r, as `ResumableLoader` does, so every layout trains on the same samples per step. The position is
``(global samples consumed, samples drawn from each source)``, the same on every rank: a checkpoint's state
continues the exact sequence (any dp, any micro-batch size), and ``source_counts()`` tells the samples each source
has given so far.
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from tpzoo.errors import ConfigError, DataError

from .loader import PrefetchingLoader, check_dp_rank, check_state, collate_long

__all__ = ["MixtureSource", "parse_mixture", "Blend", "MixtureLoader", "source_name"]

_NAME_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".text", ".md", ".rst", ".py", ".bin", ".idx")
_EXAMPLE = "WEIGHT PATH pairs, e.g. --data 0.7 web/ 0.3 code.jsonl"


@dataclass(frozen=True)
class MixtureSource:
    name: str        # for metrics: tokens_seen/<name>, eval_loss/<name>
    weight: Fraction  # normalized: the weights of a mixture sum to exactly 1
    path: str


def _looks_numeric(item: str) -> bool:
    try:
        float(item)
    except ValueError:
        return False
    return not Path(item).exists()  # a file or directory named "2024" is a path


def _weight(text, path: str, where: str) -> Fraction:
    try:
        value = Fraction(str(text).strip())  # exact: "0.1" is 1/10
    except (ValueError, ZeroDivisionError):
        value = None
    if value is None or value <= 0:
        raise ConfigError(f"{where}: the weight {text!r} of {path} is not a positive number")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not 0 < as_float < math.inf:  # 1e400, 1e-400: no float holds it (the sampler's shares are floats)
        raise ConfigError(f"{where}: the weight {text!r} of {path} is not a finite positive number in floating "
                          f"point; give weights between {sys.float_info.min:.0e} and {sys.float_info.max:.0e}")
    return value


def parse_mixture(items: Sequence[str] | None, mix: dict | None = None, where: str = "--data") \
        -> list[MixtureSource] | None:
    """The weighted sources of ``--data WEIGHT PATH [WEIGHT PATH ...]`` or of a ``[data] mix`` table
    (``{PATH: WEIGHT}``); None for plain paths (concatenated into one corpus, unweighted). Malformed input is a
    `ConfigError` of one line: a weight that is not a positive number, weights and paths that do not pair."""
    items = [str(x) for x in items or []]
    if mix:
        if items:
            raise ConfigError(f"the data is given twice: --data {' '.join(items)} and a [data] mix table; keep one")
        pairs = [(weight, str(path)) for path, weight in mix.items()]
        where = "[data] mix"
    else:
        if not any(_looks_numeric(x) for x in items):
            return None
        pairs = []
        for i in range(0, len(items), 2):
            weight, path = items[i], items[i + 1] if i + 1 < len(items) else None
            if not _looks_numeric(weight):
                try:
                    float(weight)  # nan, inf: a number, not a positive one (refused below)
                except ValueError:
                    raise ConfigError(f"{where}: {weight!r} stands where a weight should (item {i + 1}): every "
                                      f"path needs its weight ({_EXAMPLE})") from None
            if path is None:
                raise ConfigError(f"{where}: the last weight {weight} has no path ({_EXAMPLE})")
            if _looks_numeric(path):
                raise ConfigError(f"{where}: {path!r} stands where a path should (item {i + 2}): two weights in a "
                                  f"row ({_EXAMPLE})")
            pairs.append((weight, path))
    weights = [_weight(w, p, where) for w, p in pairs]
    total = sum(weights)
    for w, (text, path) in zip(weights, pairs):
        if float(w / total) == 0:  # its share is below the smallest float: it would never be sampled
            raise ConfigError(f"{where}: the weight {text!r} of {path} is too small next to the others' (its share "
                              f"{float(w):g} / {float(total):g} is 0 in floating point)")
    names = _unique([source_name(p) for _, p in pairs])
    return [MixtureSource(n, w / total, p) for n, w, (_, p) in zip(names, weights, pairs)]


def source_name(path: str) -> str:
    """A metric-friendly name for a source: its last path component without the file suffix
    (``/data/web/`` -> ``web``, ``math.jsonl`` -> ``math``, ``hf:org/set`` -> ``set``)."""
    name = re.split(r"[/\\:]", str(path).rstrip("/\\"))[-1]
    for suffix in _NAME_SUFFIXES:
        if name.lower().endswith(suffix) and len(name) > len(suffix):
            name = name[:-len(suffix)]
            break
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "data"


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}-{seen[n]}")
    return out


class Blend:
    """Which source each global sample comes from (see the module docstring), in exact integer arithmetic."""

    def __init__(self, weights: Sequence[Fraction]):
        weights = [Fraction(w) for w in weights]
        if not weights or min(weights) <= 0:
            raise ValueError(f"weights must be positive, got {weights}")
        total = sum(weights)
        weights = [w / total for w in weights]
        scale = math.lcm(*(w.denominator for w in weights))
        self.a = [int(w * scale) for w in weights]  # w_j = a_j / A, sum(a) = A
        self.A = scale
        self.k = len(weights)
        self.m = 2 * self.k - 2  # d = 1 / m

    def choose(self, n: int, counts: Sequence[int]) -> int:
        """The source of global sample n + 1, given the samples ``counts`` drawn from each in the first n."""
        if self.k == 1:
            return 0
        best = -1
        for j, (a, c) in enumerate(zip(self.a, counts)):
            # eligible: w_j (n + 1) - c_j >= 1 / m;  due: (c_j + 1 - 1/m) / w_j, compared as (m c_j + m - 1) / a_j
            if self.m * (a * (n + 1) - c * self.A) >= self.A:
                due = self.m * (c + 1) - 1
                if best < 0 or due * self.a[best] < best_due * a:
                    best, best_due = j, due
        if best < 0:  # impossible with exact arithmetic (Tijdeman's theorem); a guard, not a fallback
            raise RuntimeError(f"blend: no eligible source at sample {n} with counts {list(counts)}")
        return best

    def draw(self, n: int, counts: Sequence[int], count: int) -> tuple[list[tuple[int, int]], tuple[int, ...]]:
        """([(source, its sample number)] for global samples n .. n + count - 1, the counts after them)."""
        counts = list(counts)
        picks = []
        for i in range(count):
            j = self.choose(n + i, counts)
            picks.append((j, counts[j]))
            counts[j] += 1
        return picks, tuple(counts)

    def sources(self, n: int) -> np.ndarray:
        """The source of each of the first n global samples (for tests and inspection)."""
        picks, _ = self.draw(0, [0] * self.k, n)
        return np.asarray([j for j, _ in picks], dtype=np.int64)


class MixtureLoader(PrefetchingLoader):
    """Endless batches of a weighted mixture of map-style datasets for one data-parallel rank (see the module
    docstring); the iterator, prefetching, ``state_dict`` / ``load_state_dict`` and wait statistics of
    `ResumableLoader`. ``datasets[j]`` has the samples of source ``sources[j]``."""

    def __init__(self, sources: Sequence[MixtureSource], datasets: Sequence, micro_batch_size: int, *,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, prefetch: int = 2,
                 collate: Callable[[list[dict]], dict] = collate_long, pin_memory: bool = False):
        check_dp_rank(dp_rank, dp_size, micro_batch_size)
        if len(sources) != len(datasets):
            raise ValueError(f"{len(sources)} sources but {len(datasets)} datasets")
        for s, ds in zip(sources, datasets):
            if len(ds) == 0:
                raise DataError(f"mixture source {s.name} ({s.path}) has no training samples (shorter than one "
                                f"sequence after the held-out split)")
        super().__init__(prefetch, collate, pin_memory)
        self.sources, self.datasets = list(sources), list(datasets)
        self.blend = Blend([s.weight for s in sources])
        self.micro_batch_size, self.dp_rank, self.dp_size, self.seed = micro_batch_size, dp_rank, dp_size, seed
        self.global_micro_batch = micro_batch_size * dp_size
        self.mixture = [s.name for s in sources]
        self.weights = [str(s.weight) for s in sources]
        self.num_samples = [len(ds) for ds in datasets]
        self.pos = (0, (0,) * len(sources))
        self._perms: dict[int, tuple[int, np.ndarray]] = {}

    def _index(self, j: int, c: int) -> int:
        epoch, i = divmod(c, self.num_samples[j])
        cached = self._perms.get(j)
        if cached is None or cached[0] != epoch:  # one permutation per source and epoch
            cached = self._perms[j] = (epoch, np.random.default_rng([self.seed, j, epoch])
                                       .permutation(self.num_samples[j]))
        return int(cached[1][i])

    def _make_batch(self, pos):
        n, counts = pos
        picks, counts = self.blend.draw(n, counts, self.global_micro_batch)
        mine = picks[self.dp_rank * self.micro_batch_size:(self.dp_rank + 1) * self.micro_batch_size]
        batch = self._collate([self.datasets[j][self._index(j, c)] for j, c in mine])
        return batch, (n + self.global_micro_batch, counts)

    def _finished(self, pos) -> bool:
        return False

    @property
    def consumed_samples(self) -> int:
        return self.pos[0]

    def source_counts(self) -> dict[str, int]:
        """Global samples each source has given the consumer so far (all ranks, since the start of training)."""
        return dict(zip(self.mixture, self.pos[1]))

    def state_dict(self) -> dict:
        return {"mixture": self.mixture, "weights": self.weights, "consumed_samples": self.pos[0],
                "counts": list(self.pos[1]), "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, self, ("mixture", "weights", "seed", "num_samples"), "mixture")
        n, counts = int(state["consumed_samples"]), tuple(int(c) for c in state["counts"])
        if sum(counts) != n or len(counts) != len(self.sources):
            raise DataError(f"mixture loader state is inconsistent: counts {list(counts)} for {n} samples")
        self._seek((n, counts))
