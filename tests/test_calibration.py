"""The confidence-calibration figures of the offline eval (consumer/evaluation/calibration.py) against hand-computed
values."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from dflash_ring.consumer.evaluation.calibration import (
    auroc,
    brier_score,
    confidence_calibration,
    expected_calibration_error,
    prefix_predictions,
    reliability_bins,
    sigmoid,
)

PREDICTED = [0.05, 0.15, 0.12, 0.95, 0.91, 0.5]
OUTCOMES = [False, False, True, True, False, True]


def test_reliability_bins_and_ece_by_hand():
    bins = reliability_bins(PREDICTED, OUTCOMES)
    assert [b.count for b in bins] == [1, 2, 0, 0, 0, 1, 0, 0, 0, 2]
    assert bins[1].mean_predicted == pytest.approx(0.135) and bins[1].observed == 0.5
    assert bins[9].mean_predicted == pytest.approx(0.93) and bins[9].observed == 0.5
    assert bins[2].mean_predicted is None and bins[2].observed is None
    assert (bins[5].lo, bins[5].hi) == (0.5, 0.6)
    # bins 0, 1, 5, 9: (1 * .05 + 2 * |.135 - .5| + 1 * |.5 - 1| + 2 * |.93 - .5|) / 6 = 2.14 / 6
    assert expected_calibration_error(PREDICTED, OUTCOMES) == pytest.approx(2.14 / 6)
    # 1.0 falls in the last bin, 0.1 in the second; two bins: [0, .5) and [.5, 1]
    assert [b.count for b in reliability_bins([1.0, 0.1, 0.0], [True, False, False])] == [1, 1] + [0] * 7 + [1]
    assert expected_calibration_error([0.2, 0.4, 0.6, 1.0], [False, True, True, True], bins=2) == pytest.approx(
        (2 * abs(0.3 - 0.5) + 2 * abs(0.8 - 1.0)) / 4
    )


def test_brier_by_hand():
    # (.05^2 + .15^2 + .88^2 + .05^2 + .91^2 + .5^2) / 6
    assert brier_score(PREDICTED, OUTCOMES) == pytest.approx(1.88 / 6)
    assert brier_score([1.0, 0.0], [True, False]) == 0.0


def test_auroc_by_hand():
    # positives .12, .95, .5 against negatives .05, .15, .91: 1 + 3 + 2 of 9 pairs ranked right
    assert auroc(PREDICTED, OUTCOMES) == pytest.approx(6 / 9)
    # ties count one half: (pos .3 ~ neg .3: 1/2) + (pos .3 < neg .7: 0) + (pos .7 > neg .3: 1) + (pos .7 ~ neg .7: 1/2)
    assert auroc([0.3, 0.3, 0.7, 0.7], [True, False, True, False]) == pytest.approx(0.5)
    assert auroc([0.2, 0.2, 0.2], [True, False, True]) == pytest.approx(0.5)
    assert auroc([0.9, 0.1], [True, False]) == 1.0 and auroc([0.1, 0.9], [True, False]) == 0.0
    assert auroc([0.4, 0.6], [True, True]) is None and auroc([0.4, 0.6], [False, False]) is None


def brute_force_auroc(predicted, outcomes):
    pairs = [(p, n) for p, y in zip(predicted, outcomes) if y for n, z in zip(predicted, outcomes) if not z]
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


def test_auroc_equals_a_pairwise_count_with_many_ties():
    rng = random.Random(0)
    for size in (2, 7, 50, 300):
        predicted = [round(rng.random(), 1) for _ in range(size)]  # 11 values: ties everywhere
        outcomes = [rng.random() < p for p in predicted]
        outcomes[0], outcomes[-1] = True, False
        assert auroc(predicted, outcomes) == pytest.approx(brute_force_auroc(predicted, outcomes), abs=1e-12)


def test_prefix_products_and_outcomes_by_hand():
    logits = [[0.0, math.log(3), -math.log(3)], [2.0, 0.0, 1.0]]  # sigmoid: (.5, .75, .25); (s(2), .5, s(1))
    per_position = prefix_predictions([(logits[0], 2), (logits[1], 0)])
    expected = [[0.5, sigmoid(2.0)], [0.375, sigmoid(2.0) * 0.5], [0.09375, sigmoid(2.0) * 0.5 * sigmoid(1.0)]]
    for (predicted, _), want in zip(per_position, expected):
        assert predicted == pytest.approx(want)
    assert [y for _, y in per_position] == [[True, False], [True, False], [False, False]]
    assert sigmoid(-800.0) == 0.0 and sigmoid(800.0) == 1.0  # no overflow either way


def test_confidence_calibration_per_position_and_pooled():
    rounds = [([1.0, 0.5, -1.0], a) for a in (0, 1, 2, 3)] + [([3.0, 2.0, 1.0], 3)]
    calibration = confidence_calibration(rounds)
    assert calibration.bins == 10 and [p.position for p in calibration.positions] == [1, 2, 3]
    per_position = prefix_predictions(rounds)
    for row, (predicted, outcomes) in zip(calibration.positions, per_position):
        assert row.count == 5
        assert row.observed == pytest.approx(sum(outcomes) / 5)
        assert row.mean_predicted == pytest.approx(sum(predicted) / 5)
        assert row.ece == pytest.approx(expected_calibration_error(predicted, outcomes))
        assert row.brier == pytest.approx(brier_score(predicted, outcomes))
        assert row.auroc == auroc(predicted, outcomes)
    assert [r.observed for r in calibration.positions] == pytest.approx([4 / 5, 3 / 5, 2 / 5])
    assert calibration.positions[0].auroc == pytest.approx(brute_force_auroc(*per_position[0]))
    pooled_p = list(itertools.chain.from_iterable(p for p, _ in per_position))
    pooled_y = list(itertools.chain.from_iterable(y for _, y in per_position))
    assert calibration.pooled.position == 0 and calibration.pooled.count == 15
    assert calibration.pooled.ece == pytest.approx(expected_calibration_error(pooled_p, pooled_y))
    assert calibration.pooled.auroc == pytest.approx(brute_force_auroc(pooled_p, pooled_y))
    assert confidence_calibration([]) is None


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="2 predictions but 1 outcomes"):
        brier_score([0.1, 0.2], [True])
    with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
        reliability_bins([1.5], [True])
    with pytest.raises(ValueError, match="accepted 4 of 3"):
        prefix_predictions([([0.0, 0.0, 0.0], 4)])
    with pytest.raises(ValueError, match="different numbers"):
        prefix_predictions([([0.0], 0), ([0.0, 0.0], 1)])
