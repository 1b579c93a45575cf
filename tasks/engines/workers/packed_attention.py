"""Attention over the shared-prefix layout (packing.pack_shared) that computes only the pairs a packed group allows.

A packed row holds groups laid out as a prompt, then its responses. A response may see its prompt and itself, at the
positions it would have alone; a prompt sees itself. A dense (L, L) mask expresses that, but scaled-dot-product
attention with an arbitrary mask computes every pair: at 8 responses of 1,024 tokens after a 256-token prompt, 71 M
pairs for 5 M allowed, and the mask alone grows with L² (1 GB a row at 4,096-token responses).

Here every segment (a group's prompt alone, and each response with its prompt before it) is gathered from the row into
a sequence of its own and run through causal SDPA with no mask (`is_causal=True`: the flash kernels on the CPU and on
CUDA skip the blocks above the diagonal). A response's outputs are scattered back to its positions, the prompt's come
from its own segment. The pairs computed are each segment's triangle: the prompt's queries are recomputed once per
response, so at a 150-token prompt the work is 1.16× the allowed pairs at 256-token responses and 1.01× at 4,096
(`PackedLayout.pairs`). Segments of similar length share one SDPA call, padded at their ends (causal attention never
lets a real query see a later pad), so a layer makes a few calls, not one per response.

Chosen over FlexAttention by measurement (docs/long-responses.md "Attention"): on this CPU, FlexAttention compiles a
kernel per shape (tens of seconds on 2 cores) and needs the compiler at training time, while SDPA's flash kernels
need nothing; on CUDA the same code runs SDPA's flash or memory-efficient kernels.

The layout is built from the batch's per-position (group, segment) id vectors with tensor operations on the model's
device (no (L, L) tensor, no Python loop over tokens); only the segment lengths go to the host, to form the buckets.

Models take it through transformers' AttentionInterface under the name ATTENTION ("rlpipe_packed"): `install(model)`
sets it the first time a packed batch meets the model (SharedPrefixBatch.model_inputs); a forward given
`packed=<PackedLayout>` uses it, any other forward (a padded batch, a plain causal pass) runs transformers' own SDPA
attention unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = "rlpipe_packed"

# Segments share one SDPA call while padding to the longest costs at most this share of their triangles' pairs.
BUCKET_SLACK = 0.10


@dataclass(frozen=True)
class PackedLayout:
    """What the attention needs for one packed batch of G rows of length L, on the model's device.

    gathers: one (S, Lb) long tensor per bucket: for each of its S segments, the flat positions (row · L + column) of
    its tokens in order (the prompt, then the response), padded at the end with its last token's position.
    source: (G · L,) long: for each flat position, the index of its output in the concatenation of the buckets'
    flattened (S · Lb) outputs; padding positions point one past the end (a zero row).
    pairs: (query, key) pairs computed (each padded segment's causal triangle) and allowed (the dense mask's count)."""

    gathers: tuple[torch.Tensor, ...]
    source: torch.Tensor
    computed_pairs: int
    allowed_pairs: int


def _runs(*keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) of the runs of consecutive positions where every one of the 1-D `keys` stays the same."""
    change = torch.zeros_like(keys[0], dtype=torch.bool)
    change[0] = True
    for key in keys:
        change[1:] |= key[1:] != key[:-1]
    starts = change.nonzero().squeeze(1)
    ends = torch.cat([starts[1:], starts.new_tensor([len(change)])])
    return starts, ends - starts


def _buckets(lengths: list[int]) -> list[list[int]]:
    """Segment indices grouped for one SDPA call each: longest first, a segment joining the current bucket while the
    bucket's length squared stays within (1 + BUCKET_SLACK) of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and lengths[out[-1][0]] ** 2 <= (1 + BUCKET_SLACK) * lengths[i] ** 2:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _segments(group: torch.Tensor, segment: torch.Tensor):
    """The segments of a packed batch, each as flat positions: (prompt starts, prompt lengths, response starts,
    response lengths), every prompt alone first (it writes the prompt's outputs), then every response after its
    prompt; with how many prompts there are and the pairs the layout allows."""
    rows, length = segment.shape
    flat_row = torch.arange(rows, device=segment.device).repeat_interleave(length)  # (G·L,)
    seg, grp = segment.reshape(-1), group.reshape(-1)
    # A run is a prompt or a response: consecutive positions with one (row, group, segment). Padding positions are
    # runs of one (each its own segment id), left out.
    starts, lens = _runs(flat_row, grp, seg)
    starts, lens = starts[seg[starts] >= 0], lens[seg[starts] >= 0]
    is_prompt = seg[starts] == 0
    owner = flat_row[starts] * (length + 1) + grp[starts]  # (runs,): the (row, group) a run belongs to
    p_starts, p_lens, r_starts, r_lens = starts[is_prompt], lens[is_prompt], starts[~is_prompt], lens[~is_prompt]
    at = torch.searchsorted(owner[is_prompt], owner[~is_prompt])  # each response's prompt (in row, then group order)
    allowed = (p_lens * (p_lens + 1) // 2).sum() + (p_lens[at] * r_lens + r_lens * (r_lens + 1) // 2).sum()
    spans = (
        torch.cat([p_starts, p_starts[at]]),
        torch.cat([p_lens, p_lens[at]]),
        torch.cat([p_starts + p_lens, r_starts]),  # a prompt's own segment has no response part
        torch.cat([torch.zeros_like(p_lens), r_lens]),
    )
    return spans, len(p_lens), int(allowed)


def packed_layout(group: torch.Tensor, segment: torch.Tensor) -> PackedLayout:
    """The layout of a packed batch from its (G, L) id vectors: `group` numbers the groups within a row, `segment` is 0
    on a prompt, k ≥ 1 on one response, negative on padding (as packing.pack_shared lays them out). Runs where the
    tensors are."""
    device = segment.device
    (p_start, p_len, r_start, r_len), prompts, allowed = _segments(group, segment)
    total = (p_len + r_len).tolist()  # the one transfer to the host: a length per segment
    source = torch.full((segment.numel(),), -1, dtype=torch.long, device=device)
    gathers, offset, computed = [], 0, 0
    for bucket in _buckets(total):
        b = torch.tensor(bucket, dtype=torch.long, device=device)
        width = total[bucket[0]]
        j = torch.arange(width, device=device).unsqueeze(0)  # (1, Lb)
        ps, pl, rs, rl = (t[b].unsqueeze(1) for t in (p_start, p_len, r_start, r_len))  # (S, 1) each
        in_prompt, in_response = j < pl, (j >= pl) & (j < pl + rl)
        last = torch.where(rl > 0, rs + rl - 1, ps + pl - 1)
        gather = torch.where(in_prompt, ps + j, torch.where(in_response, rs + j - pl, last))  # (S, Lb)
        writes = in_response | (in_prompt & (b < prompts).unsqueeze(1))  # (S, Lb): prompt segments write prompts
        out_at = offset + torch.arange(len(bucket) * width, device=device).view(len(bucket), width)
        source[gather[writes]] = out_at[writes]
        gathers.append(gather)
        offset += len(bucket) * width
        computed += len(bucket) * width * (width + 1) // 2
    source = torch.where(source < 0, offset, source)  # padding reads the zero row appended after every output
    return PackedLayout(tuple(gathers), source, computed, allowed)


def packed_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed: PackedLayout | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """transformers' attention-function contract: query (G, H, L, D), key and value (G, Hkv, L, D) → ((G, L, H, D),
    None). With `packed`, each bucket of segments is one causal SDPA call; without, transformers' SDPA attention."""
    if packed is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    g, heads, length, dim = query.shape
    repeat = heads // key.shape[1]
    q = query.transpose(1, 2).reshape(g * length, heads, dim)  # (G·L, H, D)
    k = key.transpose(1, 2).reshape(g * length, key.shape[1], dim)  # (G·L, Hkv, D)
    v = value.transpose(1, 2).reshape(g * length, key.shape[1], dim)
    outs = []
    for gather in packed.gathers:
        s, width = gather.shape
        flat = gather.reshape(-1)
        qs = q.index_select(0, flat).view(s, width, heads, dim).transpose(1, 2)  # (S, H, Lb, D)
        ks, vs = (
            t.index_select(0, flat).view(s, width, -1, dim).transpose(1, 2).repeat_interleave(repeat, dim=1)
            for t in (k, v)
        )  # (S, H, Lb, D) each
        mask, causal = None, True
        if sliding_window is not None and width > sliding_window:  # a banded mask: these pairs are all allowed
            back = torch.arange(width, device=query.device)
            back = back.unsqueeze(1) - back.unsqueeze(0)  # (Lb, Lb): how far back the key is
            mask, causal = (back >= 0) & (back < sliding_window), False
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal, dropout_p=dropout, scale=scaling
        )  # (S, H, Lb, D)
        outs.append(out.transpose(1, 2).reshape(s * width, heads, dim))
    outs.append(query.new_zeros(1, heads, dim))  # what padding positions read
    return torch.cat(outs).index_select(0, packed.source).view(g, length, heads, dim), None


def register() -> None:
    """Make ATTENTION known to transformers (idempotent): the attention function, and SDPA's mask builder for the
    forwards that pass an ordinary mask."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def install(model) -> None:
    """Set the model's attention to ATTENTION (wrapped or not), once: every packed forward calls it, so that no model,
    however it was loaded, reads the placeholder mask as a real one. One clear error for a model class that does not
    take transformers' attention interface."""
    from transformers import PreTrainedModel

    # The outermost transformers model inside whatever wraps it (a DeepSpeed engine, peft, a value head).
    inner = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if inner is None:
        raise ValueError(f"{type(model).__name__} holds no transformers model, which rlpipe's packed batches need")
    if inner.config._attn_implementation == ATTENTION:
        return
    register()
    inner.set_attn_implementation(ATTENTION)
    if inner.config._attn_implementation != ATTENTION:
        raise ValueError(
            f"{type(inner).__name__} does not take transformers' attention interface, which packed batches need"
        )
