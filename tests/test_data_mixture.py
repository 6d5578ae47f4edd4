"""tpzoo.data.mixture: the WEIGHT PATH syntax, blending within one sample of every weight at every prefix (where
Megatron's greedy rule is not), per-source epochs, the same samples at any dp, exact resume."""
from fractions import Fraction

import numpy as np
import pytest

from tpzoo.data import Blend, MixtureLoader, ResumableLoader, parse_mixture
from tpzoo.errors import ConfigError, DataError


# -- the syntax ------------------------------------------------------------------------------------------------

def test_weight_path_pairs_names_and_normalized_weights():
    srcs = parse_mixture(["0.7", "corpora/web/", "0.2", "/data/code_text_document", "0.1", "math.jsonl"])
    assert [(s.name, s.weight, s.path) for s in srcs] == [
        ("web", Fraction(7, 10), "corpora/web/"), ("code_text_document", Fraction(1, 5), "/data/code_text_document"),
        ("math", Fraction(1, 10), "math.jsonl")]
    srcs = parse_mixture(["3", "a/web", "1", "b/web"])  # Megatron normalizes; equal names are told apart
    assert [(s.name, s.weight) for s in srcs] == [("web", Fraction(3, 4)), ("web-2", Fraction(1, 4))]
    assert parse_mixture(["a.txt", "b/"]) is None and parse_mixture([]) is None  # plain paths: one corpus
    table = parse_mixture([], {"web/": 0.7, "code.jsonl": "0.3"})  # [data] mix (TOML) / --mix web/=0.7
    assert [(s.name, s.weight) for s in table] == [("web", Fraction(7, 10)), ("code", Fraction(3, 10))]


@pytest.mark.parametrize("items,says", [
    (["0", "web/", "1", "code/"], "--data: the weight '0' of web/ is not a positive number"),
    (["-0.5", "web/", "1", "code/"], "--data: the weight '-0.5' of web/ is not a positive number"),
    (["nan", "web/", "1", "code/"], "--data: the weight 'nan' of web/ is not a positive number"),
    (["0.7", "web/", "0.3"], "--data: the last weight 0.3 has no path"),
    (["0.7", "web/", "code/"], "--data: 'code/' stands where a weight should (item 3)"),
    (["web/", "0.3", "code/"], "--data: 'web/' stands where a weight should (item 1)"),
    (["0.7", "0.3", "web/", "code/"], "--data: '0.3' stands where a path should (item 2)"),
])
def test_malformed_mixtures_are_one_line(items, says):
    with pytest.raises(ConfigError) as e:
        parse_mixture(items)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_the_mixture_is_given_once():
    with pytest.raises(ConfigError, match="the data is given twice"):
        parse_mixture(["a.txt"], {"web/": 1})
    with pytest.raises(ConfigError, match=r"\[data\] mix: the weight 'x' of web/ is not a positive number"):
        parse_mixture([], {"web/": "x"})


# -- blending ----------------------------------------------------------------------------------------------------

def deviation(sources: np.ndarray, weights) -> float:
    """max over prefixes n and sources j of |samples of j in the first n - w_j n|."""
    k = len(weights)
    counts = np.cumsum(np.eye(k)[sources], axis=0)
    n = np.arange(1, len(sources) + 1)[:, None]
    return float(np.abs(counts - n * np.asarray([float(w) for w in weights])).max())


def megatron_greedy(weights, n: int) -> np.ndarray:
    """Megatron-LM's build_blending_indices (helpers.cpp), written out: the source most behind w * max(i, 1)."""
    w = np.asarray([float(x) for x in weights])
    counts, out = np.zeros(len(w)), []
    for i in range(n):
        j = int(np.argmax(w * max(i, 1) - counts))
        counts[j] += 1
        out.append(j)
    return np.asarray(out)


@pytest.mark.parametrize("k", [2, 3, 4, 6])
def test_every_prefix_is_within_one_sample_of_every_weight(k):
    rng = np.random.default_rng(k)
    bound = 1 - 1 / (2 * k - 2)  # Tijdeman's theorem: below one sample
    for _ in range(12):
        raw = [Fraction(int(x), 1000) for x in rng.integers(1, 1000, k) ** 2]  # skewed weights too
        weights = [w / sum(raw) for w in raw]
        assert deviation(Blend(weights).sources(500), weights) <= bound + 1e-9


def test_megatrons_greedy_rule_can_fall_a_sample_behind_ours_cannot():
    weights = [Fraction(1, 20), Fraction(1, 20), Fraction(9, 10)]
    assert deviation(megatron_greedy(weights, 400), weights) > 1.1  # the check above would fail on it
    assert deviation(Blend(weights).sources(400), weights) <= 0.75
    # on the mixture both keep within one sample, and the blend depends on the weights alone
    mix = [Fraction(3, 5), Fraction(3, 10), Fraction(1, 10)]
    assert deviation(megatron_greedy(mix, 400), mix) < 1 and deviation(Blend(mix).sources(400), mix) <= 0.75
    assert np.bincount(Blend(mix).sources(1000)).tolist() == [600, 300, 100]


# -- the loader --------------------------------------------------------------------------------------------------

class Tagged:
    """Sample i of source s is the array [s, i]: a batch tells where each row came from."""

    def __init__(self, source: int, n: int):
        self.source, self.n = source, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        assert 0 <= i < self.n
        return {"input_ids": np.array([self.source, i])}


MIX = parse_mixture(["0.6", "a", "0.3", "b", "0.1", "c"])
SIZES = [40, 9, 3]  # c has 3 samples: exhausted every 30 global samples, a new shuffled epoch each time


def loader(dp_rank=0, dp_size=1, mbs=2, prefetch=0, seed=5, mix=MIX):
    return MixtureLoader(mix, [Tagged(j, n) for j, n in enumerate(SIZES)], mbs, dp_rank=dp_rank, dp_size=dp_size,
                         seed=seed, prefetch=prefetch)


def rows(batches) -> list[tuple[int, int]]:
    return [tuple(r) for b in batches for r in b["input_ids"].tolist()]


def test_prefixes_per_source_epochs_and_the_same_samples_at_any_dp():
    steps, gbs = 200, 8
    one = loader()
    drawn = rows(next(one) for _ in range(steps * gbs // 2))
    sources = np.asarray([s for s, _ in drawn])
    assert deviation(sources, [s.weight for s in MIX]) <= 0.75  # every prefix, not only every step
    assert one.source_counts() == {"a": 960, "b": 480, "c": 160} and one.consumed_samples == 1600
    for j, n in enumerate(SIZES):  # each source: whole epochs, each a permutation, reshuffled every epoch
        seq = [i for s, i in drawn if s == j]
        epochs = [seq[e:e + n] for e in range(0, len(seq) - n + 1, n)]
        assert all(sorted(e) == list(range(n)) for e in epochs)
        assert len({tuple(e) for e in epochs}) > 1
    # dp = 2 (micro-batch 2 each): rank 0 then rank 1 of each global micro-batch are the single process's samples
    ranks = [loader(dp_rank=r, dp_size=2, prefetch=2) for r in range(2)]
    per_rank = [[next(ranks[r]) for _ in range(40)] for r in range(2)]
    assert rows(b for pair in zip(*per_rank) for b in pair) == drawn[:160]
    assert ranks[0].state_dict() == ranks[1].state_dict() == loader_at(160).state_dict()
    for r in ranks:
        r.close()


def loader_at(n_samples: int, **kw) -> MixtureLoader:
    ld = loader(**kw)
    for _ in range(n_samples // ld.global_micro_batch):
        next(ld)
    return ld


def test_resume_mid_run_continues_exactly_and_refuses_other_data():
    straight = loader_at(77 * 8, prefetch=2)
    state = straight.state_dict()
    assert state["consumed_samples"] == 616 and sum(state["counts"]) == 616
    expected = rows(next(straight) for _ in range(50))
    straight.close()
    resumed = loader(prefetch=1)
    next(resumed)  # a running loader too: prefetched batches are dropped
    resumed.load_state_dict(state)
    assert rows(next(resumed) for _ in range(50)) == expected
    resumed.close()
    # at another dp and micro-batch size the same global sequence continues: rank r of 4 takes sample r
    assert rows(next(loader_with(state, dp_rank=r, dp_size=4, mbs=1)) for r in range(4)) == expected[:4]

    with pytest.raises(DataError, match=r"loader state has weights=\['3/5', '3/10', '1/10'\] but this loader has"):
        loader(mix=parse_mixture(["0.5", "a", "0.3", "b", "0.2", "c"])).load_state_dict(state)
    with pytest.raises(DataError, match="loader state has seed=5 but this loader has 6"):
        loader(seed=6).load_state_dict(state)
    single = ResumableLoader(Tagged(0, 40), 2, prefetch=0)
    with pytest.raises(DataError, match="the checkpoint's data-loader state is a weighted mixture's, but this run's "
                                        "data is one corpus"):
        single.load_state_dict(state)
    with pytest.raises(DataError, match="state is a single corpus's, but this run's data is a weighted mixture"):
        loader().load_state_dict(single.state_dict())


def loader_with(state, **kw) -> MixtureLoader:
    ld = loader(**kw)
    ld.load_state_dict(state)
    return ld


def test_the_mix_table_in_a_config_file_and_on_the_command_line(tmp_path):
    import argparse

    from tpzoo.commands import pretrain
    from tpzoo.train.config import config_from_args, load_config

    toml = tmp_path / "run.toml"
    toml.write_text('[data.mix]\n"corpora/web/" = 0.7\n"math.jsonl" = 0.3\n')
    cfg = load_config(str(toml))
    assert cfg.mix == {"corpora/web/": 0.7, "math.jsonl": 0.3} and cfg.data == []
    assert [(s.name, s.weight) for s in parse_mixture(cfg.data, cfg.mix)] == [("web", Fraction(7, 10)),
                                                                            ("math", Fraction(3, 10))]
    (tmp_path / "again.toml").write_text(cfg.to_toml())  # --print-config writes it back as an inline table
    assert load_config(str(tmp_path / "again.toml")).mix == cfg.mix
    p = argparse.ArgumentParser()
    pretrain.add_arguments(p)
    cfg = config_from_args(p.parse_args(["--tp", "1", "--mix", "web/=2", "code/=1"]))
    assert cfg.mix == {"web/": "2", "code/": "1"}
    assert [s.weight for s in parse_mixture(cfg.data, cfg.mix)] == [Fraction(2, 3), Fraction(1, 3)]
    with pytest.raises(ConfigError, match="the data is given twice"):
        config_from_args(p.parse_args(["--tp", "1", "--mix", "web/=2", "--data", "x.txt"])).validate()
