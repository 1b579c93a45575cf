"""How samples are grouped and cut into micro-batches: pure Python over token counts, no torch, so that every rank
computes the same partition from the same request (tasks/engines/workers/data_parallel.py).

- Groups: the samples of one prompt share its token ids; the shared-prefix layout (packing.pack_shared) computes
  each prompt once per micro-batch, so micro-batches hold whole groups where they can.
- Rows: a micro-batch's groups go in one row (the packed attention costs nothing more for a longer row), or, when asked,
  in rows of about a number of tokens (balanced_rows).
- Token budgets (optim.micro_batch_tokens, as verl's dynamic batch size): groups, or pieces of a group too long for the
  budget, dealt to the ranks by tokens (karmarkar_karp) and packed into micro-batches that keep the budget
  (fitted_rows).
"""

from __future__ import annotations


def balanced_rows(sizes: list[int], row_tokens: int) -> list[list[int]]:
    """Indices of `sizes` (groups' token counts) per row: as few rows as first-fit decreasing needs with rows of at
    most max(`row_tokens`, the largest group), then the groups dealt longest first to the emptiest of that many rows.
    First-fit alone fills rows in turn and leaves the last nearly empty (4 groups of ~280 tokens: rows of 840 and
    280, a third of the positions padding); dealing evens them out (560 and 560) at the same number of rows."""
    order = _longest_first(sizes)
    return _deal(sizes, order, _first_fit_bins(sizes, order, max(row_tokens, max(sizes))))


def fitted_rows(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indices of `sizes` per bin, no bin over `capacity` unless one item alone is: as many bins as first-fit
    decreasing needs, the items dealt longest first to the emptiest bin they fit in (a new bin where none has room).
    balanced_rows evens rows out and may overfill one; a micro-batch's token budget is a bound, so this one keeps it."""
    if not sizes:
        return []
    order = _longest_first(sizes)
    return _deal(sizes, order, _first_fit_bins(sizes, order, capacity), capacity)


def _longest_first(sizes: list[int]) -> list[int]:
    return sorted(range(len(sizes)), key=lambda i: -sizes[i])


def _first_fit_bins(sizes: list[int], order: list[int], capacity: int) -> int:
    """How many bins of `capacity` first-fit takes for the items in `order` (an item over it fills one alone)."""
    used: list[int] = []
    for i in order:
        at = next((b for b, u in enumerate(used) if u + sizes[i] <= capacity), None)
        if at is None:
            used.append(0)
            at = len(used) - 1
        used[at] += sizes[i]
    return len(used)


def _deal(sizes: list[int], order: list[int], bins: int, capacity: int | None = None) -> list[list[int]]:
    """The items in `order`, each to the emptiest of `bins` bins (the first of equals); with `capacity`, the emptiest
    it fits in (an empty bin takes anything), or a new bin where none has room."""
    out: list[list[int]] = [[] for _ in range(bins)]
    load = [0] * bins
    for i in order:
        fits = [b for b in range(len(out)) if capacity is None or load[b] + sizes[i] <= capacity or not out[b]]
        if not fits:
            out.append([])
            load.append(0)
            fits = [len(out) - 1]
        at = min(fits, key=lambda b: load[b])
        out[at].append(i)
        load[at] += sizes[i]
    return out


def karmarkar_karp(sizes: list[int], parts: int) -> list[list[int]]:
    """Indices of `sizes` split into `parts` subsets of near-equal sums by the largest differencing method (Karmarkar
    and Karp 1982, k-way, as verl's seqlen_balancing uses to balance ranks): every item starts as a partial partition of
    its own; the two partial partitions of largest spread (largest minus smallest sum) are merged, the largest subset of
    one with the smallest of the other, until one is left. Deterministic: ties are broken by index, never by chance.
    Subsets come out by decreasing sum."""
    import heapq

    if parts <= 1:
        return [list(range(len(sizes)))]
    heap = []
    for i, size in enumerate(sizes):
        state = [(size, [i])] + [(0, []) for _ in range(parts - 1)]
        heap.append((-size, i, state))
    heapq.heapify(heap)
    made = len(sizes)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)  # each state is sorted by decreasing sum
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))), key=_by_sum_then_items)
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], made, merged))
        made += 1
    state = heap[0][2] if heap else [(0, []) for _ in range(parts)]
    return [sorted(items) for _, items in state]


def _by_sum_then_items(subset: tuple[int, list[int]]):
    return -subset[0], subset[1]


def token_pieces(indices: list[int], prompts: list[list[int]], responses: list[list[int]], budget: int):
    """The units a token budget packs: each group (the samples of one prompt) whole when its prompt and responses fit in
    `budget` tokens, else cut into consecutive pieces that do, each with the prompt again (a sample longer than the
    budget is a piece alone). Returns (pieces, their token counts)."""
    pieces, sizes = [], []
    for group in groups_of(indices, prompts):
        prompt_len = len(prompts[group[0]])
        piece, used = [], prompt_len
        for i in group:
            if piece and used + len(responses[i]) > budget:
                pieces.append(piece), sizes.append(used)
                piece, used = [], prompt_len
            piece.append(i)
            used += len(responses[i])
        pieces.append(piece), sizes.append(used)
    return pieces, sizes


def token_micro_batches(
    indices: list[int], prompts: list[list[int]], responses: list[list[int]], budget: int, world_size: int = 1
) -> list[list[list[int]]]:
    """Every rank's micro-batches of `indices` under a budget of `budget` tokens each (optim.micro_batch_tokens), as
    verl's dynamic batch size: the groups, or their pieces (token_pieces), are dealt to the ranks by tokens
    (karmarkar_karp), then each rank's are packed into as few micro-batches of at most `budget` tokens as first-fit
    decreasing needs and evened out (fitted_rows). With several ranks every rank gets as many micro-batches as the
    busiest, an empty one being a dummy step (data_parallel.micro_steps). A pure function of its arguments: every rank
    computes the same partition. Samples stay whole, so every aggregation's minibatch normaliser is unchanged."""
    if not indices:
        return [[] for _ in range(world_size)]
    pieces, sizes = token_pieces(indices, prompts, responses, budget)
    per_rank = []
    for share in karmarkar_karp(sizes, world_size):
        rows = fitted_rows([sizes[p] for p in share], budget)
        per_rank.append([[i for at in row for i in pieces[share[at]]] for row in rows])
    if world_size > 1:
        most = max(map(len, per_rank))
        per_rank = [parts + [[] for _ in range(most - len(parts))] for parts in per_rank]
    return per_rank


def groups_of(indices: list[int], prompts: list[list[int]]) -> list[list[int]]:
    """`indices` by prompt (a group's samples share its token ids), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i in indices:
        groups.setdefault(tuple(prompts[i]), []).append(i)
    return list(groups.values())


def group_order(indices: list[int], prompts: list[list[int]]) -> list[int]:
    """`indices` with the samples of one prompt next to each other, so that consecutive micro-batches hold whole groups
    and share their prompts."""
    return [i for group in groups_of(indices, prompts) for i in group]


def chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def forward_micro_batches(
    prompts: list[list[int]], responses: list[list[int]], micro_batch_size: int, micro_tokens: int | None = None
) -> list[list[int]]:
    """The micro-batches of a pass without gradients over every sample: whole groups together, `micro_batch_size`
    samples each, or with a token budget as token_micro_batches packs them (one list: the passes deal micro-batches
    to the ranks themselves, map_in_order)."""
    if micro_tokens is None:
        return chunks(group_order(list(range(len(prompts))), prompts), micro_batch_size)
    return token_micro_batches(list(range(len(prompts))), prompts, responses, micro_tokens)[0]
