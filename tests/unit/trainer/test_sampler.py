"""The global cursor: any sequence of world sizes reads every stream position exactly once."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disttrain.api.manifest import DatasetFingerprint
from disttrain.trainer import sampler


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1, 2, 3, 4, 6]), st.integers(1, 5)), min_size=1, max_size=6))
def test_world_size_changes_neither_replay_nor_skip_any_position(segments):
    global_batch = 12
    cursor, seen = 0, Counter()
    for world, steps in segments:
        for _ in range(steps):
            for rank in range(world):
                seen.update(sampler.rank_positions(cursor, global_batch, world, rank))
            cursor += global_batch
    assert seen == Counter(range(cursor))


def test_each_epoch_is_a_permutation_and_steps_straddle_the_epoch_boundary():
    s = sampler.GlobalSampler(length=10, seed=5)
    first, second = s.indices(list(range(10))), s.indices(list(range(10, 20)))
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # a fresh permutation per epoch
    assert s.indices(list(range(8, 12))) == first[8:] + second[:2]  # nothing dropped, nothing padded


def test_the_permutation_depends_only_on_seed_and_epoch():
    assert sampler.GlobalSampler(50, 1).indices(list(range(50))) == sampler.GlobalSampler(50, 1).indices(
        list(range(50))
    )
    assert sampler.GlobalSampler(50, 1).indices(list(range(50))) != sampler.GlobalSampler(50, 2).indices(
        list(range(50))
    )


@pytest.mark.parametrize(
    ("saved", "words"),
    [
        (DatasetFingerprint(length=99, seed=3), ["length: checkpoint has 99, this run has 100"]),
        (DatasetFingerprint(length=100, seed=4), ["seed: checkpoint has 4, this run has 3"]),
        (DatasetFingerprint(length=100, seed=3, permutation_version=0), ["permutation_version"]),
        (DatasetFingerprint(length=1, seed=1), ["length", "seed"]),
    ],
    ids=["length", "seed", "version", "several"],
)
def test_a_changed_stream_is_refused_naming_what_changed(saved, words):
    with pytest.raises(sampler.DatasetChangedError) as err:
        sampler.check_fingerprint(saved, sampler.fingerprint(100, 3))
    for w in words:
        assert w in str(err.value)


def test_an_unchanged_stream_is_accepted():
    sampler.check_fingerprint(sampler.fingerprint(100, 3), sampler.fingerprint(100, 3))


def test_a_global_batch_that_the_world_cannot_split_is_an_error():
    with pytest.raises(ValueError, match="not a multiple"):
        sampler.rank_positions(0, 10, 4, 0)
