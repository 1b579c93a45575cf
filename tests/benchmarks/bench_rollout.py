"""Rollout benchmark: rlpipe's resident vLLM engine against HF transformers `generate` on the same ~20M-parameter
model (infra/model/bench_llama_20m.yaml), the same 64 prompts, G = 8 samples each, max_tokens = 64, temperature 1.

Tokens/s counts the response tokens each side actually produced (up to EOS), over the generation wall time
only: vLLM's engine start and HF's model load are excluded from both.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import polars as pl
import torch

from schemas.requests import GenerateRequest, VLLMSettings
from tasks.data.model_recipe import init_model
from tasks.engines.vllm_client import ResidentEngine
from tests.benchmarks import result_row
from tests.conftest import generation_job

PROMPTS, GROUP, MAX_TOKENS = 64, 8, 64
RECIPE = Path("infra/model/bench_llama_20m.yaml")


def _prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(f"{i % 100:02d}+{(7 * i) % 100:02d}=")["input_ids"] for i in range(PROMPTS)]


def hf_tokens_per_second(model_dir: Path, prompt_ids: list[list[int]]) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(map(len, prompt_ids))  # left padding, as decoder-only generation needs
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
    attn = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompt_ids])[:, None]).long()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            num_return_sequences=GROUP,
            max_new_tokens=MAX_TOKENS,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    seconds = time.perf_counter() - t0
    new = out[:, width:]  # (P·G, ≤ MAX_TOKENS)
    is_eos = (new == tok.eos_token_id).long()
    # Tokens up to and including the first EOS; generate pads the rest of a finished row.
    produced = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, torch.full((new.shape[0],), new.shape[1]))
    return float(produced.sum()) / seconds


def vllm_tokens_per_second(model_dir: Path, prompt_ids: list[list[int]], work: Path) -> float:
    prompts = work / "prompts.parquet"
    pl.DataFrame(
        {"prompt_id": [f"p{i}" for i in range(len(prompt_ids))], "prompt_token_ids": prompt_ids},
        schema={"prompt_id": pl.Utf8, "prompt_token_ids": pl.List(pl.Int32)},
    ).write_parquet(prompts)
    job = generation_job(prompts, work / "out.parquet", n=GROUP, max_tokens=MAX_TOKENS)
    request = GenerateRequest(model_path=str(model_dir), jobs=(job,))
    engine = ResidentEngine(work / "vllm.log")
    settings = VLLMSettings(
        model_path=str(model_dir), dtype="float32", seed=0, kv_cache_gib=2, gpu_memory_utilization=0.5
    )
    try:
        engine.generate(request, settings)  # warm-up: the first generate pays one-off compilation
        timing = engine.generate(request, settings).jobs[0]
    finally:
        engine.close()
    return timing.tokens / timing.generate_seconds


def run() -> list[dict]:
    from transformers import AutoTokenizer

    model_dir = init_model(RECIPE, Path("runs/bench/model-20m"))
    prompt_ids = _prompt_ids(AutoTokenizer.from_pretrained(model_dir))
    with tempfile.TemporaryDirectory() as work:
        ours = vllm_tokens_per_second(model_dir, prompt_ids, Path(work))
    base = hf_tokens_per_second(model_dir, prompt_ids)
    return [result_row("rollout_vllm_vs_hf", "HF transformers generate", base, ours, "tokens/s")]
