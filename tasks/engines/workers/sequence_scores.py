"""Scoring worker: forward passes without training (schemas.requests.ScoreRequest) over token ids the stages made.

- `rm_score`: a trained reward model's score of each (prompt_token_ids, response_token_ids) row: the RL scores stage
  (the very tokens sampled), eval, and the reward model's held-out pairs.
- `seq_logprobs`: a causal LM's sequence logprob (sum over response tokens, EOS included) of each pair's chosen and
  rejected response (DPO's reference and its held-out eval).
No Prefect import: this runs in its own process.
"""

from __future__ import annotations

from schemas.requests import ScoreRequest
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


def reward_model(path: str, tokenizer):
    """A sequence-classification head with one label, read at the last non-pad token."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = rm_pad_id(tokenizer, model.config.vocab_size)
    return model


def rm_scores(model, input_ids, attention_mask):
    """(N,) scores of packed prompt+response sequences."""
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()


def sequence_logps(model, input_ids, attention_mask, response_mask):
    """(N,) sum of log π over each response's tokens (EOS included)."""
    from tasks.engines.workers.token_batch import token_logprobs

    logp, _ = token_logprobs(model, input_ids, attention_mask, with_entropy=False)
    return (logp * response_mask).sum(dim=1)


def _rm_score(request: ScoreRequest, tokenizer) -> None:
    import polars as pl

    from tasks.engines.workers.token_batch import batched

    data = pl.read_parquet(request.data_path)
    model = reward_model(request.model_path, tokenizer).eval()
    scores = batched(lambda ids, attn, mask, plen, rlen: rm_scores(model, ids, attn).tolist(), data["prompt_token_ids"].to_list(),
                     data["response_token_ids"].to_list(), model.config.pad_token_id, request.micro_batch_size)
    data.with_columns(pl.Series("score", scores, dtype=pl.Float64)).write_parquet(request.out_path)


def _seq_logprobs(request: ScoreRequest, tokenizer) -> None:
    import polars as pl
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.engines.workers.token_batch import batched

    data = pl.read_parquet(request.data_path)
    model = AutoModelForCausalLM.from_pretrained(request.model_path, dtype=torch.float32).eval()
    prompts, out = data["prompt_token_ids"].to_list(), {}
    for side in ("chosen", "rejected"):
        values = batched(lambda ids, attn, mask, plen, rlen: sequence_logps(model, ids, attn, mask).tolist(), prompts,
                         data[f"{side}_token_ids"].to_list(), pad_id(tokenizer), request.micro_batch_size)
        out[f"{side}_logp"] = pl.Series(values, dtype=pl.Float64)
    data.select("prompt_id", "pair_idx").with_columns(**out).write_parquet(request.out_path)


def handle(request: ScoreRequest) -> dict:
    import time

    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(request.model_path)
    (_rm_score if request.kind == "rm_score" else _seq_logprobs)(request, tokenizer)
    return {"seconds": time.time() - t0}


if __name__ == "__main__":
    worker_main(handle)
