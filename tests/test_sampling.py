"""The sampler's choice on numpy rows (``kvshelf.runtime.sampling``): its nucleus is the
one a full sort defines, its draws follow the tempered probabilities (inside the nucleus,
renormalized), a token of probability 0 is never drawn, and a seed repeats its tokens."""

from __future__ import annotations

import numpy as np
import pytest

from kvshelf.runtime.sampling import DRAW_CHUNK, Sampler, _nucleus


def _sorted_nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """The definition: most likely first, keep each token whose predecessors' mass is < top_p."""
    order = np.argsort(-weights, kind="stable")
    p = weights[order] / weights.sum(dtype=np.float64)
    return order[(np.cumsum(p) - p) < top_p]


@pytest.mark.parametrize("spread", [0.3, 3.0, 30.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_the_nucleus_is_the_one_a_full_sort_gives(spread, top_p):
    rng = np.random.default_rng(int(spread * 10) + int(top_p * 1000))
    for _ in range(5):
        logits = (rng.standard_normal(20000) * spread).astype(np.float32)
        weights = np.exp(logits - logits.max())
        mine, want = _nucleus(weights, top_p), _sorted_nucleus(weights, top_p)
        assert len(mine) == len(want) and set(mine.tolist()) == set(want.tolist())
        assert np.all(np.diff(weights[mine]) <= 0)  # most likely first


def _frequencies(sampler: Sampler, logits: np.ndarray, n: int) -> np.ndarray:
    return np.bincount([sampler(logits) for _ in range(n)], minlength=len(logits)) / n


def test_draws_follow_the_tempered_probabilities_across_chunks():
    """Four tokens spread over several ``DRAW_CHUNK``s, the rest banned (-inf) or of
    probability 0 after tempering."""
    logits = np.full(5 * DRAW_CHUNK + 7, -np.inf, dtype=np.float32)
    where = [0, DRAW_CHUNK + 3, 3 * DRAW_CHUNK - 1, 5 * DRAW_CHUNK + 6]
    logits[where] = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    logits[17] = -200.0  # exp underflows at temperature 0.5: never drawn
    freq = _frequencies(Sampler(temperature=0.5, seed=11), logits, 20000)
    assert set(np.flatnonzero(freq).tolist()) == set(where)
    tempered = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    assert np.allclose(freq[where], tempered / tempered.sum(), atol=0.015)


def test_top_p_draws_inside_the_nucleus_renormalized():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    freq = _frequencies(Sampler(temperature=1.0, top_p=0.7, seed=5), logits, 20000)
    assert np.allclose(freq, [0.625, 0.375, 0.0, 0.0], atol=0.015)


def test_greedy_and_top_p_0_take_the_top_token_and_a_seed_repeats_its_tokens():
    logits = np.random.default_rng(2).standard_normal(262144).astype(np.float32)
    top = int(np.argmax(logits))
    assert Sampler()(logits) == top and Sampler(temperature=1.0, top_p=0.0)(logits) == top
    first, again = Sampler(temperature=1.0, seed=99), Sampler(temperature=1.0, seed=99)
    draws = [first(logits) for _ in range(20)]
    assert draws == [again(logits) for _ in range(20)]
    assert len(set(draws)) > 1  # it samples: 20 draws over 262144 flat-ish logits differ


def test_penalties_and_bias_apply_before_the_choice():
    logits = np.zeros(8, dtype=np.float32)
    logits[3] = 5.0
    assert Sampler(logit_bias={6: 100})(logits) == 6
    sampler = Sampler(frequency_penalty=2.0, presence_penalty=2.0)
    assert [sampler(logits) for _ in range(3)] == [3, 3, 0]  # 5, then 5 - 4, then 5 - 6
    assert logits[3] == 5.0  # the step's row itself is not changed
