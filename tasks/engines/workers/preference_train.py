"""Preference worker (DeepSpeed for training, torch for scoring). Modes:

- `rm_train`: a Bradley–Terry reward model, `AutoModelForSequenceClassification` (one label, scoring the
  last non-pad token) on the model_path backbone. Data: rankings (prompt, responses, ranks); a ranking is
  ONE batch element whose loss is the mean over its pairs (tasks/algos/preference_losses.py).
- `rm_score`: a trained reward model's score of each (prompt, response[, eos]) row.
- `seq_logprobs`: a causal LM's sequence logprob (sum over response tokens) of chosen and rejected per pair.
- `dpo_train`: DPO on pairs (prompt, chosen, rejected, ref_chosen_logp, ref_rejected_logp), plus
  nll_coef × the chosen responses' per-token NLL when nll_coef > 0 (RPO).

The stages send token ids (tasks/data/formatting.py made them: the formatted prompt, and each response with its
EOS), so the reward model reads the response's end and DPO counts the choice to stop. Requests: model_path,
data_path, and out_path (scores) or tmp_dir/metrics_path (training: steps, batch_size, micro_batch_size, lr,
warmup_steps, weight_decay, zero_stage, seed, dtype, gradient_checkpointing, beta).
"""

from __future__ import annotations

import math
import time

from tasks.data.formatting import pad_id
from tasks.engines.launch import worker_main


def rm_pad_id(tokenizer, vocab_size: int) -> int:
    """The reward model's head reads the last token that is not padding, so padding must differ from EOS (which ends
    most responses): the tokenizer's pad token, or else the id after EOS (stock GPT-2 and many Llama tokenizers have
    no pad token)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad is not None and pad != eos:
        return int(pad)
    return (int(eos) + 1) % vocab_size if eos is not None else 0


def _lr(request, step: int) -> float:
    """Linear warmup, then cosine to 10% (as the SFT trainer)."""
    steps, warmup = request["steps"], request["warmup_steps"]
    return request["lr"] * min(1.0, (step + 1) / max(1, warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))


def _trainer(model, request):
    """The DeepSpeed engine, accumulating micro-batches up to batch_size elements."""
    from tasks.engines.workers.deepspeed_train import _engine

    gas = math.ceil(request["batch_size"] / min(request["micro_batch_size"], request["batch_size"]))
    return _engine(model, request, gas)


def _steps(request, optimizer, n: int):
    """For each optimizer step, with its learning rate set: (step, lr, micro-batches of element indices),
    batch_size elements drawn at random."""
    import torch

    gen = torch.Generator().manual_seed(request["seed"])
    bs, micro = request["batch_size"], min(request["micro_batch_size"], request["batch_size"])
    for step in range(request["steps"]):
        lr = _lr(request, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = torch.randint(n, (bs,), generator=gen).tolist()
        yield step, lr, [batch[i : i + micro] for i in range(0, bs, micro)]


def _log_progress(rows: list[dict], every: int = 50) -> None:
    """A line in the worker's log every `every` steps (the means since the last line), to follow a long run."""
    if len(rows) % every == 0:
        recent = rows[-every:]
        keys = [k for k in recent[0] if k not in ("step", "lr")]
        means = " ".join(f"{k}={sum(r[k] for r in recent) / len(recent):.4f}" for k in keys)
        print(f"step {len(rows)}: {means}", flush=True)


def _rm_model(path: str, tokenizer):
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = rm_pad_id(tokenizer, model.config.vocab_size)  # the head reads the last non-pad token
    return model


def _rm_forward(model, prompts, responses, pad_id):
    """Scores (N,) of prompt+response sequences."""
    from tasks.engines.workers.token_batch import pack

    ids, attn, _ = pack(prompts, responses, pad_id)
    return model(input_ids=ids, attention_mask=attn).logits[:, 0].float()


def _rm_train(request, tokenizer):
    import polars as pl
    import torch

    from tasks.algos.preference_losses import kwise_bradley_terry, pairwise_accuracy

    data = pl.read_parquet(request["data_path"])
    seqs = [([p] * len(rs), rs) for p, rs in zip(data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list())]
    ranks = data["ranks"].to_list()
    model = _rm_model(request["model_path"], tokenizer)
    engine, optimizer = _trainer(model, request)
    pad = model.config.pad_token_id
    rows = []
    for step, lr, parts in _steps(request, optimizer, data.height):
        loss_sum, correct, pairs = 0.0, 0.0, 0
        for k, idx in enumerate(parts):
            width = max(len(ranks[i]) for i in idx)
            flat_p = [x for i in idx for x in seqs[i][0]]
            flat_r = [x for i in idx for x in seqs[i][1]]
            flat = _rm_forward(engine, flat_p, flat_r, pad)  # (sum of K,)
            scores = torch.zeros(len(idx), width)  # (B, K): rankings of different K, padded
            valid = torch.zeros(len(idx), width, dtype=torch.bool)
            rank_t = torch.zeros(len(idx), width, dtype=torch.long)
            offset = 0
            for row, i in enumerate(idx):
                k_i = len(ranks[i])
                scores[row, :k_i] = flat[offset : offset + k_i]
                valid[row, :k_i] = True
                rank_t[row, :k_i] = torch.tensor(ranks[i])
                offset += k_i
            # A sum over elements divided by the whole batch: the accumulated gradient is the batch mean.
            loss = kwise_bradley_terry(scores, rank_t, valid).sum() / request["batch_size"]
            engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            loss_sum += float(loss.detach())
            c, n = pairwise_accuracy(scores.detach(), rank_t, valid)
            correct, pairs = correct + c, pairs + n
        rows.append({"step": step, "loss": loss_sum, "lr": lr, "train_pair_accuracy": correct / max(pairs, 1)})
        _log_progress(rows)
    return engine, pl.DataFrame(rows, schema={"step": pl.Int32, "loss": pl.Float64, "lr": pl.Float64, "train_pair_accuracy": pl.Float64})


def _rm_score(request, tokenizer) -> None:
    import polars as pl
    import torch

    from tasks.engines.workers.token_batch import chunks

    data = pl.read_parquet(request["data_path"])
    prompts, responses = data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list()
    model = _rm_model(request["model_path"], tokenizer).eval()
    scores = []
    with torch.no_grad():
        for idx in chunks(list(range(data.height)), request["micro_batch_size"]):
            scores += _rm_forward(model, [prompts[i] for i in idx], [responses[i] for i in idx], model.config.pad_token_id).tolist()
    data.with_columns(pl.Series("score", scores, dtype=pl.Float64)).write_parquet(request["out_path"])


def _sequence_logps(model, prompts, responses, pad_id):
    """(N,) sum of log π over each response's tokens (EOS included)."""
    from tasks.engines.workers.token_batch import pack, token_logprobs

    ids, attn, mask = pack(prompts, responses, pad_id)
    logp, _ = token_logprobs(model, ids, attn, with_entropy=False)
    return (logp * mask).sum(dim=1)


def _seq_logprobs(request, tokenizer) -> None:
    import polars as pl
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.engines.workers.token_batch import chunks

    data = pl.read_parquet(request["data_path"])
    model = AutoModelForCausalLM.from_pretrained(request["model_path"], dtype=torch.float32).eval()
    prompts, out = data["prompt_token_ids"].to_list(), {}
    for side in ("chosen", "rejected"):
        responses = data[f"{side}_token_ids"].to_list()
        values = []
        with torch.no_grad():
            for idx in chunks(list(range(data.height)), request["micro_batch_size"]):
                values += _sequence_logps(model, [prompts[i] for i in idx], [responses[i] for i in idx], pad_id(tokenizer)).tolist()
        out[f"{side}_logp"] = pl.Series(values, dtype=pl.Float64)
    data.select("prompt_id", "pair_idx").with_columns(**out).write_parquet(request["out_path"])


def _dpo_train(request, tokenizer):
    import polars as pl
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.algos.preference_losses import chosen_nll, dpo_loss

    data = pl.read_parquet(request["data_path"])
    pc = pr = data["prompt_token_ids"].to_list()
    rc, rr = data["chosen_token_ids"].to_list(), data["rejected_token_ids"].to_list()
    ref_c, ref_r = torch.tensor(data["ref_chosen_logp"].to_list()), torch.tensor(data["ref_rejected_logp"].to_list())
    model = AutoModelForCausalLM.from_pretrained(request["model_path"], dtype=torch.float32)
    model.config.use_cache = False
    engine, optimizer = _trainer(model, request)
    rows = []
    for step, lr, parts in _steps(request, optimizer, data.height):
        totals = dict.fromkeys(("loss", "reward_margin", "reward_accuracy", "chosen_logp", "rejected_logp"), 0.0)
        for k, idx in enumerate(parts):
            # Chosen and rejected in one forward pass: (2B,) sequence logprobs.
            logps = _sequence_logps(engine, [pc[i] for i in idx] + [pr[i] for i in idx], [rc[i] for i in idx] + [rr[i] for i in idx],
                                    pad_id(tokenizer))
            chosen, rejected = logps[: len(idx)], logps[len(idx) :]
            stats = dpo_loss(chosen, rejected, ref_c[idx], ref_r[idx], request["beta"])
            loss = stats.loss
            if request.get("nll_coef"):
                nll = chosen_nll(chosen, torch.tensor([float(len(rc[i])) for i in idx]))
                loss = loss + request["nll_coef"] * nll
                totals["chosen_nll"] = totals.get("chosen_nll", 0.0) + float(nll.detach()) * len(idx) / request["batch_size"]
            weight = len(idx) / request["batch_size"]  # the accumulated gradient is the batch mean
            engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            engine.backward(loss * weight, scale_wrt_gas=False)
            engine.step()
            margin = stats.chosen_rewards - stats.rejected_rewards
            totals["loss"] += float(stats.loss.detach()) * weight
            totals["reward_margin"] += float(margin.sum()) / request["batch_size"]
            totals["reward_accuracy"] += float((margin > 0).float().sum()) / request["batch_size"]
            totals["chosen_logp"] += float(chosen.detach().sum()) / request["batch_size"]
            totals["rejected_logp"] += float(rejected.detach().sum()) / request["batch_size"]
        rows.append({"step": step, "lr": lr, **totals})
        _log_progress(rows)
    return engine, pl.DataFrame(rows).with_columns(pl.col("step").cast(pl.Int32), pl.exclude("step").cast(pl.Float64))


def handle(request: dict) -> dict:
    import deepspeed
    import torch
    from transformers import AutoTokenizer

    from tasks.engines.workers.deepspeed_train import _save

    torch.manual_seed(request.get("seed", 0))
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(request["model_path"])
    mode = request["mode"]
    if mode in ("rm_score", "seq_logprobs"):
        (_rm_score if mode == "rm_score" else _seq_logprobs)(request, tokenizer)
        return {"seconds": time.time() - t0}
    engine, table = (_rm_train if mode == "rm_train" else _dpo_train)(request, tokenizer)
    train_seconds = time.time() - t0
    table.write_parquet(request["metrics_path"])
    _save(engine, tokenizer, request["tmp_dir"])
    return {"train_seconds": train_seconds, "deepspeed_version": deepspeed.__version__, "zero_stage": request["zero_stage"]}


if __name__ == "__main__":
    worker_main(handle)
