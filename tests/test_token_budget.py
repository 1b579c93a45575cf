"""Token-budget micro-batches (optim.micro_batch_tokens): the pure partition (every sample once and whole, no
micro-batch over the budget, ranks balanced by tokens, the same result every time), checked against hand-worked
cases and a brute-force optimum."""

import itertools
import random

import pytest

from tasks.engines.workers.micro_batches import (
    fitted_rows,
    forward_micro_batches,
    karmarkar_karp,
    token_micro_batches,
    token_pieces,
)


def test_karmarkar_karp_hand_worked():
    # Two-way: 8,7,6,5,4 → differences: (8,7)→1, (6,5)→1, 4 → {4},{1},{1} → 4−1 = 3 → 3−1 = 2: sums 16 and 14.
    two = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in part) for part in two) == [14, 16]
    assert sorted(i for part in two for i in part) == [0, 1, 2, 3, 4]
    assert karmarkar_karp([5, 5, 5, 5], 2) in ([[0, 3], [1, 2]], [[0, 2], [1, 3]], [[1, 2], [0, 3]], [[1, 3], [0, 2]])
    assert karmarkar_karp([3, 1], 3) == [[0], [1], []]
    assert karmarkar_karp([], 2) == [[], []]
    assert karmarkar_karp([4, 2], 1) == [[0, 1]]


@pytest.mark.parametrize("seed", range(20))
def test_karmarkar_karp_is_within_an_item_of_the_optimum_and_deterministic(seed):
    rnd = random.Random(seed)
    sizes = [rnd.randint(1, 400) for _ in range(rnd.randint(2, 9))]
    parts = karmarkar_karp(sizes, 2)
    assert karmarkar_karp(list(sizes), 2) == parts
    spread = abs(sum(sizes[i] for i in parts[0]) - sum(sizes[i] for i in parts[1]))
    best = min(
        abs(sum(s for s, side in zip(sizes, sides) if side) - sum(s for s, side in zip(sizes, sides) if not side))
        for sides in itertools.product((0, 1), repeat=len(sizes))
    )
    assert best <= spread <= max(sizes)  # differencing never leaves more than the largest item between the two sides


def test_fitted_rows_never_overfill_where_balanced_dealing_would():
    # Capacity 10: first-fit decreasing needs 2 bins (6+4, 4+3+3); dealing to the emptiest alone would make 6+3 and
    # 4+4+3 = 11. Every bin keeps the bound; an item over it goes alone.
    rows = fitted_rows([6, 4, 4, 3, 3], 10)
    assert all(sum([6, 4, 4, 3, 3][i] for i in row) <= 10 for row in rows)
    assert sorted(i for row in rows for i in row) == [0, 1, 2, 3, 4]
    assert fitted_rows([25, 3], 10) == [[0], [1]]
    assert fitted_rows([], 10) == []


def lengths(seed: int, groups: int = 6, group_size: int = 4):
    rnd = random.Random(seed)
    prompts, responses = [], []
    for g in range(groups):
        prompt = [g + 1] * rnd.randint(3, 9)
        for _ in range(group_size):
            prompts.append(prompt)
            responses.append([7] * rnd.choice([1, 5, 20, 60, 150]))  # a long tail, as reasoning responses have
    return prompts, responses


def cost(part, prompts, responses):
    """A micro-batch's tokens in the shared-prefix layout: each distinct prompt once, then its responses."""
    return sum(len(p) for p in {tuple(prompts[i]) for i in part}) + sum(len(responses[i]) for i in part)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed", range(5))
def test_token_micro_batches_cover_every_sample_once_within_the_budget(world, seed):
    prompts, responses = lengths(seed)
    budget = 256
    minibatch = list(range(len(prompts)))
    every = token_micro_batches(minibatch, prompts, responses, budget, world)
    assert every == token_micro_batches(minibatch, prompts, responses, budget, world)  # deterministic
    assert len(every) == world
    assert sorted(i for parts in every for part in parts for i in part) == minibatch
    if world > 1:
        assert len({len(parts) for parts in every}) == 1  # lockstep: dummies fill the ranks with fewer
    for parts in every:
        for part in parts:
            assert cost(part, prompts, responses) <= budget or len(part) == 1
    loads = [sum(cost(part, prompts, responses) for part in parts) for parts in every]
    longest_piece = max(token_pieces(minibatch, prompts, responses, budget)[1])
    assert max(loads) - min(loads) <= longest_piece  # balanced by tokens


def test_groups_stay_whole_when_they_fit_and_are_cut_in_order_when_not():
    prompts = [[1, 1]] * 3 + [[2, 2, 2]] * 3
    responses = [[5] * 4, [5] * 4, [5] * 4, [5] * 30, [5] * 30, [5] * 50]
    pieces, sizes = token_pieces(list(range(6)), prompts, responses, 64)
    # Group 1: 2 + 12 = 14 tokens, whole. Group 2: 3 + 30 + 30 = 63 fits; 63 + 50 does not: its last sample is cut off
    # with the prompt again (3 + 50).
    assert pieces == [[0, 1, 2], [3, 4], [5]] and sizes == [14, 63, 53]
    assert token_pieces([0, 1], prompts, [[5] * 100, [5] * 3], 64) == ([[0], [1]], [102, 5])  # too long: alone


def test_forward_micro_batches_default_to_group_ordered_chunks_of_samples():
    prompts = [[1], [2], [1], [2]]
    responses = [[5], [5], [5], [5]]
    assert forward_micro_batches(prompts, responses, 3) == [[0, 2, 1], [3]]
    budget = forward_micro_batches(prompts, responses, 3, micro_tokens=16)
    assert sorted(i for part in budget for i in part) == [0, 1, 2, 3] and len(budget) == 1
