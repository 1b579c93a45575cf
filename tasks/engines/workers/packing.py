"""The layouts that samples are packed in for a model's forward pass.

Every pass (the policy's old and reference logprobs, the update, the critic, SFT, DPO, the reward and process reward
models) runs on the shared-prefix layout (`pack_shared`). A group's G responses share one prompt, so each distinct
prompt is computed once: its group is laid out as the prompt, then each of its responses, every response at the
positions it would have alone, and the packed attention (tasks/engines/workers/packed_attention.py) lets a response
see its prompt and itself only, computing no other pair. All groups of a micro-batch go in one row: no padding. Logits
are computed only where a response token is predicted. Per-token values live on the (N, R) response grid: response
token j of sample i at column j. With G = 8 samples of 30 tokens after a 35-token prompt, a group is 275 tokens instead
of 8 × 65 = 520.

The padded layout (`pack`: prompt + response per row, right-padded, values on the (N, L−1) next-token grid) remains
for a reward model without a `score` head, and as the plain reference in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cached_property

import torch

from tasks.engines.workers.micro_batches import balanced_rows
from tasks.engines.workers.packed_attention import PackedLayout, install, packed_layout


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Return input_ids (N, L), attention_mask (N, L) and response_mask (N, L−1)."""
    n = len(prompts)
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length - 1), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = p + r
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        response_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return input_ids, attention, response_mask


@dataclass(frozen=True)
class SharedPrefixBatch:
    """N samples packed with their shared prompts in G rows of length L; see the module docstring."""

    input_ids: torch.Tensor  # (G, L) long
    position_ids: torch.Tensor  # (G, L) long: each response restarts after its prompt
    group: torch.Tensor  # (G, L) long: the position's group within its row (negative on padding)
    segment: torch.Tensor  # (G, L) long: 0 on a prompt, i + 1 on sample i's response, negative (distinct) on padding
    keep: torch.Tensor  # (K,) long: the union over rows of the positions whose logits are needed
    rows: torch.Tensor  # (T,) long: for each of the T response tokens, its row ...
    kept_cols: torch.Tensor  # (T,) long: ... and the index in `keep` of the position that predicts it
    positions: torch.Tensor  # (T,) long: that position itself (when the model computes every position's logits)
    targets: torch.Tensor  # (T,) long: the token
    flat: torch.Tensor  # (T,) long: its cell in the flattened (N, R) response grid
    shape: tuple[int, int]  # (N, R)
    ends: torch.Tensor  # (N, 2) long: the row and position of each sample's last token (its prompt's last if empty)

    @property
    def real(self) -> torch.Tensor:
        """(G, L) bool: a prompt or response token, not padding."""
        return self.segment >= 0

    def dense_mask(self) -> torch.Tensor:
        """(G, 1, L, L) bool, True where a query may attend to a key: a response sees its prompt and itself, padding
        only itself. The reference the packed attention is tested against; no pass builds it."""
        length = self.input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=self.segment.device).tril()
        q, k = self.segment.unsqueeze(2), self.segment.unsqueeze(1)
        same_group = self.group.unsqueeze(2) == self.group.unsqueeze(1)  # (G, L, L)
        return (causal & same_group & ((q == k) | (k == 0))).unsqueeze(1)

    @cached_property
    def layout(self) -> PackedLayout:
        """The packed attention's layout (packed_attention.packed_layout), built once where the batch is."""
        return packed_layout(self.group, self.segment)

    def model_inputs(self, model) -> dict:
        """The keyword arguments of `model`'s forward pass over the batch with packed attention (installed on the model
        here: packed_attention.install): the layout built where the batch is, and a 4-D placeholder mask, which
        transformers passes through untouched instead of building one from the restarting position ids."""
        install(model)
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": torch.ones((len(self.input_ids), 1, 1, 1), dtype=torch.bool, device=self.segment.device),
            "packed": self.layout,
            "use_cache": False,
        }

    def on_grid(self, values: torch.Tensor) -> torch.Tensor:
        """(T,) per-token values → the (N, R) response grid, zeros elsewhere (differentiable)."""
        n, r = self.shape
        return torch.zeros(n * r, dtype=values.dtype, device=values.device).index_copy(0, self.flat, values).view(n, r)

    @property
    def mask(self) -> torch.Tensor:
        return self.on_grid(torch.ones(len(self.flat), device=self.flat.device))  # (N, R)

    def to(self, device) -> SharedPrefixBatch:
        """The batch with every tensor on `device` (the model's): packing runs on the CPU, the forward pass wherever the
        model is. The same batch where it is there already."""
        if self.input_ids.device == torch.device(device):
            return self
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    def counts(self, logits_kept: bool) -> dict[str, float]:
        """What one forward pass over the batch computes, for the throughput figures: real token positions, all
        positions (padding included), positions whose logits are computed, the response tokens predicted, the
        (query, key) pairs the layout allows (attention's useful work) and those the packed attention computes."""
        g, length = self.input_ids.shape
        layout = self.layout
        return {
            "tokens": float(self.real.sum()),
            "positions": float(g * length),
            "logit_positions": float(g * (len(self.keep) if logits_kept else length)),
            "predicted_tokens": float(len(self.targets)),
            "attention_pairs": float(layout.allowed_pairs),
            "attention_pairs_computed": float(layout.computed_pairs),
        }


def _arange(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop, dtype=torch.long)


def pack_shared(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int, row_tokens: int | None = None
) -> SharedPrefixBatch:
    """Pack samples with their shared prompts. Each distinct prompt's group (the prompt, then its responses) is laid out
    whole. By default every group goes in one row: packed attention works per segment, so a longer row costs nothing
    and one row has no padding. With `row_tokens`, groups are spread over rows of about that many tokens
    (balanced_rows; the tests use it to put several rows in a batch)."""
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(tuple(p), []).append(i)
    keys = list(groups)
    sizes = [len(p) + sum(len(responses[i]) for i in groups[p]) for p in keys]
    placement = [list(range(len(keys)))] if row_tokens is None else balanced_rows(sizes, row_tokens)
    used = [sum(sizes[g] for g in row) for row in placement]
    length, n, width = max(used), len(prompts), max(1, max(len(r) for r in responses))
    input_ids = torch.full((len(placement), length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(placement), length), dtype=torch.long)
    group = torch.empty((len(placement), length), dtype=torch.long)
    segment = torch.empty((len(placement), length), dtype=torch.long)
    t_rows, t_pos, t_flat, t_targets = [], [], [], []
    ends = torch.zeros((n, 2), dtype=torch.long)
    for row, placed in enumerate(placement):
        at = 0
        for g, key in enumerate(placed):
            prompt, start = keys[key], at
            plen = len(prompt)
            input_ids[row, at : at + plen] = torch.tensor(prompt, dtype=torch.long)
            position_ids[row, at : at + plen] = _arange(0, plen)
            segment[row, at : at + plen] = 0
            at += plen
            for i in groups[prompt]:
                r = len(responses[i])
                input_ids[row, at : at + r] = torch.tensor(responses[i], dtype=torch.long)
                position_ids[row, at : at + r] = _arange(plen, plen + r)
                segment[row, at : at + r] = i + 1
                if r:  # token j is predicted at the position before it: the prompt's last for j = 0
                    t_pos += [torch.tensor([start + plen - 1]), _arange(at, at + r - 1)]
                    t_rows.append(torch.full((r,), row, dtype=torch.long))
                    t_flat.append(_arange(i * width, i * width + r))
                    t_targets.append(input_ids[row, at : at + r])
                ends[i] = torch.tensor([row, at + r - 1 if r else start + plen - 1])
                at += r
            group[row, start:at] = g
        # Padding is a group and a segment of its own per position (negative), so it sees only itself.
        group[row, at:] = segment[row, at:] = -1 - _arange(0, length - at)
    empty = torch.zeros(0, dtype=torch.long)
    positions = torch.cat(t_pos) if t_pos else empty
    keep, kept_cols = torch.unique(positions, return_inverse=True)
    return SharedPrefixBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        group=group,
        segment=segment,
        keep=keep,
        rows=torch.cat(t_rows) if t_rows else empty,
        kept_cols=kept_cols,
        positions=positions,
        targets=torch.cat(t_targets) if t_targets else empty,
        flat=torch.cat(t_flat) if t_flat else empty,
        shape=(n, width),
        ends=ends,
    )
