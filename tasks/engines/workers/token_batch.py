"""Pure torch helpers shared by the logprobs and training workers: packing and per-token logprobs.

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

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import cached_property

import torch

from tasks.engines.workers.data_parallel import map_in_order
from tasks.engines.workers.micro_batches import balanced_rows, forward_micro_batches
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


def token_logprobs(model, input_ids, attention_mask, with_entropy: bool = True):
    """log π(x_{t+1} | x_≤t) and the entropy of π(·|x_≤t), both (B, L−1)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]  # (B, L-1, V)
    logits = logits.float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None  # (B, L-1)
    return logp, entropy


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


def _takes_logits_to_keep(model) -> bool:
    model = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if hasattr(model, "get_base_model"):  # and peft wraps it too (its forward passes the keyword on)
        model = model.get_base_model()
    forward = model.forward
    return "logits_to_keep" in inspect.signature(forward).parameters


def count_into(totals: dict[str, float], model, batch: SharedPrefixBatch, prefix: str) -> None:
    """Add one forward pass's counts (SharedPrefixBatch.counts) to `totals`, as `<prefix>_<name>`."""
    for key, value in batch.counts(_takes_logits_to_keep(model)).items():
        totals[f"{prefix}_{key}"] = totals.get(f"{prefix}_{key}", 0.0) + value


# Above LOGITS_AT_ONCE_BYTES of float32 logits for a micro-batch's response tokens (T × vocabulary × 4), they are
# computed in chunks of LOGITS_CHUNK_BYTES (_chunked_logprobs), each recomputed in the backward pass instead of kept:
# with long responses and a 49k-token vocabulary, 8,192 tokens' logits are 1.6 GB, and the log-sum-exp, the entropy and
# the gradient each take as much again. Measured on SmolLM2-135M, 3 rows of 1,056 tokens with gradient checkpointing:
# a peak of 5.1 GiB in chunks of 2,730 tokens, 4.0 GiB in chunks of 682. Below the threshold the model's own forward
# computes them at once: no recomputation (the output layer is ~20% of SmolLM2-135M's forward), the same bytes as ever.
LOGITS_AT_ONCE_BYTES = 512 * 2**20
LOGITS_CHUNK_BYTES = 128 * 2**20


def _output_head(model):
    """(decoder, output layer, soft cap, vocabulary size) when the model's logits are its output layer applied to its
    decoder's last hidden state, soft-capped at most (Gemma's final_logit_softcapping); None for a model that scales
    its logits some other way (Cohere's logit_scale, Granite's logits_scaling), whose own forward must run."""
    model = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    if hasattr(model, "get_base_model"):  # peft's adapters live inside the decoder's layers, which run as usual
        model = model.get_base_model()
    config = getattr(model, "config", None)
    if config is None:
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(config, key, None) not in (None, 1, 1.0) for key in ("logit_scale", "logits_scaling")):
        return None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings()
    if decoder is None or head is None or decoder is model:
        return None
    return decoder, head, getattr(config, "final_logit_softcapping", None), config.vocab_size


_HEAD_CHECKED: dict[tuple, bool] = {}


def _head_is_the_models(model, parts, batch: SharedPrefixBatch) -> bool:
    """Whether the output layer on the decoder's last hidden state gives the model's own logits, checked once per
    (decoder, output layer) class on the batch's first 16 tokens: an architecture that does more between its decoder
    and its logits than _output_head knows of keeps its own forward rather than get other logprobs. Every rank checks
    at the same call, so ZeRO-3's gathers stay in step."""
    decoder, head, cap, _ = parts
    key = (type(decoder), type(head), cap)
    if key not in _HEAD_CHECKED:
        ids = batch.input_ids[:1, :16]  # (1, ≤16), a plain causal pass
        with torch.no_grad():
            own = model(input_ids=ids, use_cache=False).logits.float()  # (1, L, V)
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
            mine = head(hidden).float()
            mine = torch.tanh(mine / cap) * cap if cap else mine
        _HEAD_CHECKED[key] = bool(torch.allclose(own, mine, atol=1e-4, rtol=1e-4))
    return _HEAD_CHECKED[key]


def _head_logprobs(hidden, targets, head, cap, with_entropy: bool, entropy_grad: bool, temperature: float = 1.0):
    """(logp, entropy or None) of `targets` (T,) from their predicting positions' hidden states (T, H), under
    softmax(logits / temperature)."""
    logits = head(hidden).float()  # (T, V)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    if temperature != 1.0:  # after the model's own soft-cap, as the sampler applies it
        logits = logits / temperature
    norm = torch.logsumexp(logits, dim=-1)  # (T,)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - norm  # (T,)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        logp_all = logits - norm.unsqueeze(-1)
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def _chunked_logprobs(
    parts, batch: SharedPrefixBatch, chunk: int, with_entropy: bool, entropy_grad: bool, temperature: float
):
    """response_logprobs over `chunk` tokens at a time: the decoder runs once, the output layer per chunk, under
    activation checkpointing when gradients flow, so no more than one chunk's (chunk × V) logits exist at once."""
    from torch.utils.checkpoint import checkpoint

    decoder, head, cap, _ = parts
    hidden = decoder(**batch.model_inputs(decoder)).last_hidden_state  # (G, L, H)
    picked = hidden[batch.rows, batch.positions]  # (T, H)
    logps, entropies = [], []
    for at in range(0, len(batch.targets), chunk):
        args = (
            picked[at : at + chunk],
            batch.targets[at : at + chunk],
            head,
            cap,
            with_entropy,
            entropy_grad,
            temperature,
        )
        if torch.is_grad_enabled():
            logp, ent = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            logp, ent = _head_logprobs(*args)
        logps.append(logp), entropies.append(ent)
    entropy = batch.on_grid(torch.cat(entropies)) if with_entropy else None
    return batch.on_grid(torch.cat(logps)), entropy


def response_logprobs(
    model, batch: SharedPrefixBatch, with_entropy: bool = True, entropy_grad: bool = False, temperature: float = 1.0
):
    """log π(y_j | x, y_<j) and the entropy of π(·| x, y_<j) for every response token, both (N, R) on the response grid,
    with π = softmax(logits / temperature): the distribution a sampler at that temperature drew from.

    The model's own forward runs (so anything it does to its logits, such as soft-capping, applies), asked for the
    logits of the needed positions only where it supports `logits_to_keep`: the prompt positions' vocabulary-sized
    products are skipped. The logprob is the logit less the log-sum-exp, so the backward pass keeps one (tokens ×
    vocabulary) tensor, not log-softmax's second one; the entropy is a metric unless `entropy_grad` (an entropy bonus
    in the loss), and then keeps none. Where the logits would exceed LOGITS_AT_ONCE_BYTES they are computed in chunks
    (_chunked_logprobs). The batch goes to the model's device first."""
    batch = batch.to(model_device(model))
    parts = _output_head(model)
    if parts is not None:
        token_bytes = 4 * parts[3]  # the vocabulary from the config: ZeRO-3 partitions the weight's shape
        if len(batch.targets) * token_bytes > LOGITS_AT_ONCE_BYTES and _head_is_the_models(model, parts, batch):
            chunk = max(1, LOGITS_CHUNK_BYTES // token_bytes)
            return _chunked_logprobs(parts, batch, chunk, with_entropy, entropy_grad, temperature)
    kwargs = batch.model_inputs(model)
    cols = batch.positions
    if _takes_logits_to_keep(model):
        kwargs["logits_to_keep"], cols = batch.keep, batch.kept_cols
    logits = model(**kwargs).logits  # (G, K, V)
    picked = logits[batch.rows, cols].float()  # (T, V)
    if temperature != 1.0:  # at 1 the bytes stay those of the plain softmax
        picked = picked / temperature
    norm = torch.logsumexp(picked, dim=-1)  # (T,)
    logp = picked.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1) - norm  # (T,)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            logp_all = picked - norm.unsqueeze(-1)
            entropy = batch.on_grid(-(logp_all.exp() * logp_all).sum(-1))  # (N, R)
    return batch.on_grid(logp), entropy


def model_device(model) -> torch.device:
    """Where the model's weights are (a DeepSpeed engine's module included): the CPU, or the rank's GPU."""
    return next(model.parameters()).device


def align_responses(values: list[list[float]], width: int) -> torch.Tensor:
    """Per-response-token values on the (N, width) response grid."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, v in enumerate(values):
        if len(v):
            out[i, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


@contextmanager
def eval_mode(model):
    """The model in eval mode for the block, then back to its previous mode (a resident engine's module trains)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _in_sample_order(parts: list[list[int]], done: list, n: int) -> list:
    out = [None] * n
    for i, row in zip((i for part in parts for i in part), done):
        out[i] = row
    return out


def batched(
    fn,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    micro_batch_size: int,
    micro_tokens: int | None = None,
) -> list:
    """fn(SharedPrefixBatch, response lengths) → one result per sample, over the shared-prefix micro-batches of whole
    groups (forward_micro_batches), without gradients; the results in sample order. With several trainer ranks the
    micro-batches are shared among them and every rank gets all the results (tasks/engines/workers/data_parallel.py)."""

    def one(idx: list[int]) -> list:
        batch = pack_shared([prompts[i] for i in idx], [responses[i] for i in idx], pad_id)
        return fn(batch, [len(responses[i]) for i in idx])

    parts = forward_micro_batches(prompts, responses, micro_batch_size, micro_tokens)
    with torch.no_grad():
        done = [row for part in map_in_order(one, parts) for row in part]
    return _in_sample_order(parts, done, len(prompts))


def batched_responses(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    micro_batch_size: int,
    with_entropy: bool,
    totals: dict[str, float] | None = None,
    micro_tokens: int | None = None,
    temperature: float = 1.0,
) -> tuple[list[list[float]], list[list[float]]]:
    """Per-token logprobs and entropies (empty lists without) of every sample, at `temperature` (response_logprobs), in
    order, computed without gradients on
    shared-prefix micro-batches of whole groups (forward_micro_batches; shared among the trainer ranks as `batched`
    does). `totals` gets this rank's forward counts (`forward_*`)."""

    def one(batch: SharedPrefixBatch, lens: list[int]) -> list:
        if totals is not None:
            count_into(totals, model, batch, "forward")
        logp, ent = response_logprobs(model, batch, with_entropy, temperature=temperature)
        return [(logp[k, :n].tolist(), ent[k, :n].tolist() if with_entropy else []) for k, n in enumerate(lens)]

    out = batched(one, prompts, responses, pad_id, micro_batch_size, micro_tokens)
    return [lp for lp, _ in out], [ent for _, ent in out]
