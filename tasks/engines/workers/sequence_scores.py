"""Scoring worker: forward passes without training (schemas.requests.ScoreRequest) over token ids the stages made.

- `rm_score`: a trained reward model's score of each (prompt_token_ids, response_token_ids) row: the RL scores stage
  (the very tokens sampled), eval, and the reward model's held-out pairs.
- `prm_score`: a process reward model's probability that each step is right, read at each step's last token (the
  rows' `step_ends`, response token indices).
- `seq_logprobs`: a causal LM's sequence logprob (sum over response tokens, EOS included) of each pair's chosen and
  rejected response (DPO's reference and its held-out eval).
No Prefect import: this runs in its own process.
"""

from __future__ import annotations

import time

import polars as pl
import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from schemas.requests import ScoreRequest
from tasks.data.formatting import pad_id
from tasks.engines.workers.data_parallel import map_in_order
from tasks.engines.workers.micro_batches import chunks, group_order
from tasks.engines.workers.packing import pack, pack_shared
from tasks.engines.workers.token_batch import response_logprobs
from tasks.engines.workers.torch_logprobs import load_lm


def rm_pad_id(tokenizer, vocab_size: int) -> int:
    """The reward model's head reads the last token that is not padding, so padding must differ from EOS (which ends
    most responses): the tokenizer's pad token, or else the id after EOS (stock GPT-2 and many Llama tokenizers have
    no pad token)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad is not None and pad != eos:
        return int(pad)
    return (int(eos) + 1) % vocab_size if eos is not None else 0


def reward_model(path: str, tokenizer):
    """A sequence-classification head with one label, read at the last non-pad token."""

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = rm_pad_id(tokenizer, model.config.vocab_size)
    return model


def process_model(path: str, tokenizer):
    """A token-classification head with one label (the logit that the step ending on the token is right), without
    dropout, so that a step's score is one deterministic forward pass."""
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
    model.config.pad_token_id = rm_pad_id(tokenizer, model.config.vocab_size)
    return model


def train_top_layers(model, n: int) -> None:
    """Freeze a reward model's backbone except its top `n` transformer blocks and what follows them (the final norm);
    the head trains too. With the embeddings and the lower blocks frozen, nothing below the lowest trainable block
    needs a gradient, so autograd skips their backward pass: about two thirds of each frozen block's share of a step
    (the top 10 of SmolLM2's 30 blocks: 2.7 s a step against 5.1 s for every weight)."""
    backbone = model.base_model
    blocks = next(
        (
            m
            for m in backbone.modules()
            if isinstance(m, torch.nn.ModuleList) and len(m) == model.config.num_hidden_layers
        ),
        None,
    )
    if blocks is None:
        raise ValueError(f"reward_model.trainable_layers: no list of transformer blocks in {type(model).__name__}")
    if n > len(blocks):
        raise ValueError(f"reward_model.trainable_layers is {n}, but the model has {len(blocks)} transformer blocks")
    top = {id(p) for block in blocks[len(blocks) - n :] for p in block.parameters()}
    in_blocks = {id(p) for p in blocks.parameters()}
    embeddings = {id(p) for m in backbone.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    for p in backbone.parameters():
        # Trainable: the top blocks, and the parameters outside every block that are not embeddings (the final norm).
        p.requires_grad_(id(p) in top or (id(p) not in in_blocks and id(p) not in embeddings))


def step_logits(model, prompts: list[list[int]], responses: list[list[int]], ends: list[list[int]], pad: int):
    """Per response, the (S,) logits of the PRM's head at its steps' last tokens (`ends`, indices into the response),
    on the shared-prefix layout (a group's prompt computed once)."""
    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    head = getattr(module, "score", None) or getattr(
        module, "classifier", None
    )  # Llama-likes: score; GPT-2: classifier
    if head is None:
        raise ValueError(f"{type(module).__name__} has no token-classification head named score or classifier")
    batch = pack_shared(prompts, responses, pad)
    hidden = module.base_model(**batch.model_inputs(module)).last_hidden_state  # (G, L, H)
    out = []
    for n, (response, at) in enumerate(zip(responses, ends)):
        row, last = batch.ends[n]  # the response's last token; its token j sits len(response) − 1 − j before it
        cols = last - (len(response) - 1) + torch.tensor(at, dtype=torch.long)
        out.append(head(hidden[row, cols])[:, 0].float())
    return out


def rm_scores(model, prompts: list[list[int]], responses: list[list[int]], pad: int):
    """(N,) reward-model scores of prompt + response sequences, read at each response's last token.

    A ranking's K responses share their prompt: on the shared-prefix layout (packing.pack_shared) the backbone
    computes it once and the head reads each response's last position. A model whose classification head is not its
    `score` layer (transformers' name for decoder-only models) is run on the padded layout instead."""

    module = getattr(model, "module", model)  # a DeepSpeed engine wraps the model
    head = getattr(module, "score", None)
    if head is None:
        ids, attn, _ = pack(prompts, responses, pad)
        return model(input_ids=ids, attention_mask=attn).logits[:, 0].float()
    batch = pack_shared(prompts, responses, pad)
    hidden = module.base_model(**batch.model_inputs(module)).last_hidden_state  # (G, L, H)
    return head(hidden[batch.ends[:, 0], batch.ends[:, 1]])[:, 0].float()  # (N,)


def sequence_logps(model, prompts: list[list[int]], responses: list[list[int]], pad: int):
    """(N,) sum of log π over each response's tokens (EOS included), on the shared-prefix layout: a pair's chosen and
    rejected responses, given together, share one pass over their prompt (packing.pack_shared)."""

    batch = pack_shared(prompts, responses, pad)
    logp, _ = response_logprobs(model, batch, with_entropy=False)  # (N, R)
    return (logp * batch.mask).sum(dim=1)


def _rm_score(request: ScoreRequest, tokenizer) -> None:
    data = pl.read_parquet(request.data_path)
    model = reward_model(request.model_path, tokenizer).eval()
    prompts, responses = data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list()
    order = group_order(list(range(data.height)), prompts)  # a prompt's responses together: one pass over it

    def one(idx: list[int]) -> list[float]:
        return rm_scores(
            model, [prompts[i] for i in idx], [responses[i] for i in idx], model.config.pad_token_id
        ).tolist()

    with torch.no_grad():
        done = [v for part in map_in_order(one, chunks(order, request.micro_batch_size)) for v in part]
    scores = [0.0] * data.height
    for i, v in zip(order, done):
        scores[i] = v
    data.with_columns(pl.Series("score", scores, dtype=pl.Float64)).write_parquet(request.out_path)


def _prm_score(request: ScoreRequest, tokenizer) -> None:
    data = pl.read_parquet(request.data_path)
    model = process_model(request.model_path, tokenizer).eval()
    prompts, responses = data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list()
    ends = data["step_ends"].to_list()
    order = group_order(list(range(data.height)), prompts)

    def one(idx: list[int]) -> list[list[float]]:
        logits = step_logits(
            model, [prompts[i] for i in idx], [responses[i] for i in idx], [ends[i] for i in idx],
            model.config.pad_token_id,
        )  # fmt: skip
        return [torch.sigmoid(x).tolist() for x in logits]

    with torch.no_grad():
        done = [v for part in map_in_order(one, chunks(order, request.micro_batch_size)) for v in part]
    probs: list[list[float]] = [[] for _ in range(data.height)]
    for i, v in zip(order, done):
        probs[i] = v
    data.with_columns(pl.Series("step_scores", probs, dtype=pl.List(pl.Float64))).write_parquet(request.out_path)


def _seq_logprobs(request: ScoreRequest, tokenizer) -> None:
    data = pl.read_parquet(request.data_path)
    model = load_lm(request.model_path, "float32")
    prompts, chosen, rejected = (
        data[c].to_list() for c in ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids")
    )

    def both(idx: list[int]) -> list[tuple[float, float]]:  # a pair's two responses in one batch: one prompt pass
        logps = sequence_logps(
            model,
            [prompts[i] for i in idx] * 2,
            [chosen[i] for i in idx] + [rejected[i] for i in idx],
            pad_id(tokenizer),
        ).tolist()
        return list(zip(logps[: len(idx)], logps[len(idx) :]))

    with torch.no_grad():
        pairs = [
            p for part in map_in_order(both, chunks(list(range(data.height)), request.micro_batch_size)) for p in part
        ]
    data.select("prompt_id", "pair_idx").with_columns(
        pl.Series("chosen_logp", [c for c, _ in pairs], dtype=pl.Float64),
        pl.Series("rejected_logp", [r for _, r in pairs], dtype=pl.Float64),
    ).write_parquet(request.out_path)


def handle(request: ScoreRequest) -> dict:
    torch.manual_seed(0)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(request.model_path)
    {"rm_score": _rm_score, "prm_score": _prm_score, "seq_logprobs": _seq_logprobs}[request.kind](request, tokenizer)
    return {"seconds": time.time() - t0}
