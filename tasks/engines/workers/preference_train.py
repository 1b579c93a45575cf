"""Preference trainer worker (schemas.requests.PreferenceTrainRequest), DeepSpeed:

- `rm`: a Bradley–Terry reward model, `AutoModelForSequenceClassification` (one label, scoring the last non-pad
  token) on the model_path backbone. Data: rankings (prompt_token_ids, response_token_ids, ranks); a ranking is ONE
  batch element whose loss is the mean over its pairs (tasks/algos/preference_losses.py).
- `prm`: a process reward model, `AutoModelForTokenClassification` (one label) on the model_path backbone. Data:
  step-labelled responses (prompt_token_ids, response_token_ids, step_ends, step_labels); the loss is the binary
  cross-entropy of each step's label at its last token, averaged over a response's steps (tasks/algos/
  preference_losses.py), the mean over the batch's responses.
- `dpo`: DPO on pairs (prompt_token_ids, chosen_token_ids, rejected_token_ids, ref_chosen_logp, ref_rejected_logp),
  plus nll_coef × the chosen responses' per-token NLL when nll_coef > 0 (RPO).

The stages send token ids (tasks/data/formatting.py made them: the formatted prompt, and each response with its EOS),
so the reward model reads the response's end and DPO counts the choice to stop.
No Prefect import: this runs in its own process.
"""

from __future__ import annotations

import time

import deepspeed
import polars as pl
import torch
from transformers import AutoTokenizer

from schemas.requests import PreferenceTrainRequest
from tasks.algos.preference_losses import (
    chosen_nll,
    dpo_loss,
    kwise_bradley_terry,
    pairwise_accuracy,
    step_label_loss,
)
from tasks.data.formatting import pad_id
from tasks.engines.workers import data_parallel
from tasks.engines.workers.deepspeed_train import load_policy
from tasks.engines.workers.sequence_scores import (
    process_model,
    reward_model,
    rm_scores,
    sequence_logps,
    step_logits,
    train_top_layers,
)
from tasks.engines.workers.training import (
    Progress,
    accumulation_steps,
    deepspeed_engine,
    save_checkpoint,
    supervised_steps,
)


def _steps(request: PreferenceTrainRequest, optimizer, n: int):
    return supervised_steps(
        request.schedule, optimizer, request.engine.lr, n, request.seed, request.engine.micro_batch_size
    )


def _engine(model, request: PreferenceTrainRequest):
    if request.trainable_layers:  # reward models only: freeze before the optimizer collects the trainable weights
        train_top_layers(model, request.trainable_layers)
    return deepspeed_engine(
        model, request.engine, accumulation_steps(request.schedule, request.engine.micro_batch_size)
    )


def _ranking_scores(flat, ranks: list[list[int]], idx: list[int]):
    """(B, K) scores, ranks and validity of rankings of different K, padded, from the flat (sum of K,) scores."""

    width = max(len(ranks[i]) for i in idx)
    scores = torch.zeros(len(idx), width)
    valid = torch.zeros(len(idx), width, dtype=torch.bool)
    rank_t = torch.zeros(len(idx), width, dtype=torch.long)
    offset = 0
    for row, i in enumerate(idx):
        k_i = len(ranks[i])
        scores[row, :k_i] = flat[offset : offset + k_i]
        valid[row, :k_i] = True
        rank_t[row, :k_i] = torch.tensor(ranks[i])
        offset += k_i
    return scores, rank_t, valid


def _rm_train(request: PreferenceTrainRequest, tokenizer):
    data = pl.read_parquet(request.data_path)
    seqs = [
        ([p] * len(rs), rs) for p, rs in zip(data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list())
    ]
    ranks = data["ranks"].to_list()
    model = reward_model(request.model_path, tokenizer)
    engine, optimizer = _engine(model, request)
    pad, bs = model.config.pad_token_id, request.schedule.batch_size
    rows, progress = [], Progress("reward model", request.schedule.steps)
    for step, lr, batch, parts in _steps(request, optimizer, data.height):
        loss_sum, correct, pairs = 0.0, 0.0, 0
        for k, idx, scale in data_parallel.micro_steps(batch, parts):
            flat = rm_scores(
                engine, [x for i in idx for x in seqs[i][0]], [x for i in idx for x in seqs[i][1]], pad
            )  # (ΣK,)
            scores, rank_t, valid = _ranking_scores(flat, ranks, idx)  # (B, K)
            # A sum over elements divided by the whole batch: the accumulated gradient is the batch mean.
            loss = kwise_bradley_terry(scores, rank_t, valid).sum() / bs
            engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            engine.backward(loss * scale, scale_wrt_gas=False)
            engine.step()
            if scale:
                loss_sum += float(loss.detach())
                c, n = pairwise_accuracy(scores.detach(), rank_t, valid)
                correct, pairs = correct + c, pairs + n
        summed = data_parallel.sum_over_ranks({"loss": loss_sum, "correct": float(correct), "pairs": float(pairs)})
        loss_sum, correct, pairs = summed["loss"], summed["correct"], summed["pairs"]
        rows.append({"step": step, "loss": loss_sum, "lr": lr, "train_pair_accuracy": correct / max(pairs, 1)})
        progress.step(step + 1, {"loss": loss_sum, "pair_accuracy": correct / max(pairs, 1)})
    return engine, pl.DataFrame(
        rows, schema={"step": pl.Int32, "loss": pl.Float64, "lr": pl.Float64, "train_pair_accuracy": pl.Float64}
    )


def _prm_train(request: PreferenceTrainRequest, tokenizer):
    data = pl.read_parquet(request.data_path)
    prompts, responses, ends, labels = (
        data[c].to_list() for c in ("prompt_token_ids", "response_token_ids", "step_ends", "step_labels")
    )
    model = process_model(request.model_path, tokenizer)
    engine, optimizer = _engine(model, request)
    pad, bs = model.config.pad_token_id, request.schedule.batch_size
    rows, progress = [], Progress("process reward model", request.schedule.steps)
    for step, lr, batch, parts in _steps(request, optimizer, data.height):
        totals = {"loss": 0.0, "right": 0.0, "steps": 0.0}
        for k, idx, scale in data_parallel.micro_steps(batch, parts):
            logits = step_logits(
                engine, [prompts[i] for i in idx], [responses[i] for i in idx], [ends[i] for i in idx], pad
            )
            targets = [torch.tensor(labels[i], dtype=torch.float32) for i in idx]
            loss = step_label_loss(logits, targets).sum() / bs  # summed over the micro batch: the batch mean
            engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            engine.backward(loss * scale, scale_wrt_gas=False)
            engine.step()
            if scale:
                totals["loss"] += float(loss.detach())
                totals["right"] += float(sum(((x.detach() > 0).float() == y).sum() for x, y in zip(logits, targets)))
                totals["steps"] += float(sum(len(y) for y in targets))
        totals = data_parallel.sum_over_ranks(totals)
        accuracy = totals["right"] / max(totals["steps"], 1.0)
        rows.append({"step": step, "loss": totals["loss"], "lr": lr, "train_step_accuracy": accuracy})
        progress.step(step + 1, {"loss": totals["loss"], "step_accuracy": accuracy})
    return engine, pl.DataFrame(
        rows, schema={"step": pl.Int32, "loss": pl.Float64, "lr": pl.Float64, "train_step_accuracy": pl.Float64}
    )


def _dpo_train(request: PreferenceTrainRequest, tokenizer):
    data = pl.read_parquet(request.data_path)
    prompts, rc, rr = (
        data["prompt_token_ids"].to_list(),
        data["chosen_token_ids"].to_list(),
        data["rejected_token_ids"].to_list(),
    )
    ref_c, ref_r = torch.tensor(data["ref_chosen_logp"].to_list()), torch.tensor(data["ref_rejected_logp"].to_list())
    engine, optimizer = _engine(load_policy(request.model_path, request.engine.lora), request)
    bs, rows, progress = request.schedule.batch_size, [], Progress("dpo", request.schedule.steps)
    for step, lr, batch, parts in _steps(request, optimizer, data.height):
        totals = dict.fromkeys(("loss", "reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp"), 0.0)
        for k, idx, scale in data_parallel.micro_steps(batch, parts):
            # Chosen and rejected in one forward pass, sharing their prompt: (2B,) sequence logprobs.
            logps = sequence_logps(
                engine, [prompts[i] for i in idx] * 2, [rc[i] for i in idx] + [rr[i] for i in idx], pad_id(tokenizer)
            )
            chosen, rejected = logps[: len(idx)], logps[len(idx) :]
            stats = dpo_loss(chosen, rejected, ref_c[idx], ref_r[idx], request.beta)
            loss = stats.loss
            if request.nll_coef:
                nll = chosen_nll(chosen, torch.tensor([float(len(rc[i])) for i in idx]))
                loss = loss + request.nll_coef * nll
                totals["chosen_nll"] = totals.get("chosen_nll", 0.0) + float(nll.detach()) * len(idx) / bs * (scale > 0)
            weight = len(idx) / bs  # the accumulated gradient is the batch mean
            engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            engine.backward(loss * weight * scale, scale_wrt_gas=False)
            engine.step()
            if not scale:
                continue
            margin = stats.chosen_rewards - stats.rejected_rewards
            totals["loss"] += float(stats.loss.detach()) * weight
            totals["reward_margin"] += float(margin.sum()) / bs
            totals["reward_accuracy"] += float((margin > 0).float().sum()) / bs
            totals["chosen_logp"] += float(chosen.detach().sum()) / bs
            totals["rejected_logp"] += float(rejected.detach().sum()) / bs
        totals = data_parallel.sum_over_ranks(totals)
        rows.append({"step": step, "lr": lr, **totals})
        progress.step(step + 1, {"loss": totals["loss"], "reward_accuracy": totals["reward_accuracy"]})
    return engine, pl.DataFrame(rows).with_columns(pl.col("step").cast(pl.Int32), pl.exclude("step").cast(pl.Float64))


def handle(request: PreferenceTrainRequest) -> dict:
    torch.manual_seed(request.seed)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(request.model_path)
    engine, table = {"rm": _rm_train, "prm": _prm_train, "dpo": _dpo_train}[request.kind](request, tokenizer)
    train_seconds = time.time() - t0
    if data_parallel.rank() == 0:
        table.write_parquet(request.metrics_path)
    save_checkpoint(engine, tokenizer, request.tmp_dir)
    return {
        "train_seconds": train_seconds,
        "deepspeed_version": deepspeed.__version__,
        "zero_stage": request.engine.zero_stage,
    }
