"""End to end against TRL on a real pretrained model (`make bench ARGS=e2e_real`): the demo config
(SmolLM2-135M-Instruct,
arithmetic questions as chat messages, the demo's own reward file), `rlpipe --algo grpo` and TRL's GRPOTrainer with the
settings tests/benchmarks/trl_match.py matches (same model, prompts, reward functions, G, prompts per round, lr and
warmup, epochs × minibatches, clip ε, k3 KL with β in the loss; every group trained), each side in a fresh process timed
from its spawn. Then the starting model and both final models are evaluated the same way: greedy decoding by HF
`generate` on the 256 held-out prompts, judged by the reward file's `correct`.

Rows: e2e_real_vs_trl (samples/s) and e2e_real_accuracy (greedy held-out accuracy after the same optimizer steps).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from tests.benchmarks import result_row
from tests.benchmarks.trl_match import in_fresh_process

CONFIG = "infra/configs/demo.yaml"
ITERATIONS = 10
WORK = Path("runs/bench/real_trl")
# TRL has no dynamic filtering: rlpipe trains every group as well.
OVERRIDES = [f"storage_root={WORK}", "batch.drop_zero_variance=false"]
BASELINE = "TRL 1.16.0 GRPOTrainer (CPU)"


def greedy_chat_accuracy(model_path: str, held_out: pl.DataFrame, max_tokens: int, judge) -> tuple[float, float]:
    """(accuracy, mean response tokens) of greedy responses to chat-message prompts, by HF generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = [
        tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in held_out["prompt"].to_list()
    ]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    correct, lengths = 0.0, 0
    for start in range(0, len(prompts), 64):
        chunk = prompts[start : start + 64]
        width = max(map(len, chunk))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                do_sample=False,
                max_new_tokens=max_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        new = out[:, width:]
        texts = tok.batch_decode(new, skip_special_tokens=True)
        answers = held_out["answer"].to_list()[start : start + 64]
        correct += sum(judge(response=t, ground_truth=a) for t, a in zip(texts, answers))
        is_eos = (new == tok.eos_token_id).long()  # tokens up to and including the first EOS (generate pads after it)
        lengths += int(torch.where(is_eos.any(1), is_eos.argmax(1) + 1, torch.full((len(chunk),), new.shape[1])).sum())
    return correct / len(prompts), lengths / len(prompts)


def run() -> list[dict]:
    from schemas.config import load_config
    from tasks.data.example_tasks import ensure_task_files
    from tasks.rewards.loader import load_function, specs_from_config

    cfg = load_config(CONFIG, OVERRIDES, "grpo")
    held_out = pl.read_parquet(ensure_task_files(cfg.task)["eval"])
    judge = load_function(specs_from_config(cfg.reward)[cfg.eval.judge])
    rl = in_fresh_process("rlpipe", CONFIG, OVERRIDES, "rlpipe", ITERATIONS)
    trl = in_fresh_process("trl", CONFIG, OVERRIDES, str(WORK / "trl-model"), ITERATIONS)
    results = {
        name: greedy_chat_accuracy(path, held_out, cfg.rollout.max_tokens, judge)
        for name, path in (("start", cfg.model.path), ("rlpipe", rl.model), ("trl", trl.model))
    }
    steps = ITERATIONS * cfg.optim.minibatches * cfg.optim.ppo_epochs
    for name, side in (("rlpipe", rl), ("TRL", trl)):
        print(
            f"e2e_real {name}: {side.samples} samples in {side.wall:.1f}s = {side.samples / side.wall:.3f} samples/s "
            f"(start-up {side.startup:.1f}s; round ends {[round(t, 1) for t in side.round_ends]})"
        )
    print(
        f"e2e_real: {steps} optimizer steps each; greedy held-out accuracy (mean response tokens) "
        + ", ".join(f"{k} {a:.3f} ({n:.1f})" for k, (a, n) in results.items())
    )
    return [
        result_row("e2e_real_vs_trl", BASELINE, trl.samples / trl.wall, rl.samples / rl.wall, "samples/s"),
        result_row("e2e_real_accuracy", BASELINE, results["trl"][0], results["rlpipe"][0], "greedy held-out accuracy"),
    ]
