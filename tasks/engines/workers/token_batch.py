"""Pure torch helpers shared by the logprobs and training workers: per-token logprobs of a packed batch (on the
layouts of tasks/engines/workers/packing.py), and passes without gradients over a batch's micro-batches.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch

from tasks.engines.workers.data_parallel import map_in_order
from tasks.engines.workers.micro_batches import forward_micro_batches
from tasks.engines.workers.packing import SharedPrefixBatch, pack_shared


def token_logprobs(model, input_ids, attention_mask, with_entropy: bool = True):
    """log π(x_{t+1} | x_≤t) and the entropy of π(·|x_≤t), both (B, L−1)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]  # (B, L-1, V)
    logits = logits.float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None  # (B, L-1)
    return logp, entropy


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
