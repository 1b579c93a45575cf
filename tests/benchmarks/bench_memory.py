"""Trainer memory with long responses (`make bench ARGS=long_memory`): one policy update of the demo model
(SmolLM2-135M-Instruct, `make model`) by the trainer worker itself (deepspeed_train.handle, fp32, ZeRO-1, one rank),
each in a fresh process so that its peak RSS is its own, on synthetic groups of 8 responses after a 32-token prompt:
the same number of response tokens at every length, under the same token budget per micro-batch
(optim.micro_batch_tokens).

Rows:
- long_memory_rss: peak RSS at 4,096-token responses against 256-token ones, 32,768 response tokens each (one group, or
  16), micro-batches of 4,160 tokens (two groups of 8 × 256, or one 4,096-token response with its prompt) (ratio:
  4,096's / 256's; the target is at most 1.25);
- long_memory_checkpointing: at 1,024-token responses (8,192 response tokens, micro-batches of 4,096),
  model.gradient_checkpointing against the activations kept (ratio: with / without);
- long_memory_logit_chunks: at 1,024-token responses, a budget of 8,192 tokens and gradient checkpointing (so that the
  logits, 8,192 × 49,152 floats, are the peak), the logits computed at once (the threshold lifted) against in chunks
  (token_batch.LOGITS_AT_ONCE_BYTES, LOGITS_CHUNK_BYTES) (ratio: chunked / at once; below 1 is memory saved).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MODEL = "models/smollm2-135m-instruct"
OUT = Path("runs/bench/long_memory")

SCRIPT = r"""
import json, random, sys
import polars as pl
from schemas.config import KLConfig, LossConfig
from schemas.requests import EngineSettings, LossSettings, UpdateRequest
import tasks.engines.workers.token_batch as token_batch
from tasks.engines.workers.deepspeed_train import handle

model, out, length, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
chunked, checkpointing, total = sys.argv[5] == "1", sys.argv[6] == "1", int(sys.argv[7])
if not chunked:
    token_batch.LOGITS_AT_ONCE_BYTES = 1 << 62
rnd = random.Random(0)
rows = []
for g in range(total // (8 * length)):
    prompt = [rnd.randrange(100, 40000) for _ in range(32)]
    for _ in range(8):
        rows.append({"prompt_token_ids": prompt, "token_ids": [rnd.randrange(100, 40000) for _ in range(length)],
                     "old_logprobs": [-2.0] * length, "ref_logprobs": [-2.0] * length,
                     "token_advantages": [rnd.uniform(-1, 1)] * length, "loss_mask": 1.0})
pl.DataFrame(rows).write_parquet(f"{out}/data.parquet")
engine = EngineSettings(zero_stage=1, lr=1e-6, weight_decay=0.0, grad_clip=1.0, micro_batch_size=64, dtype="float32",
                        gradient_checkpointing=checkpointing, lora=None, micro_batch_tokens=budget)
request = UpdateRequest(model_path=model, tmp_dir=f"{out}/ckpt", data_path=f"{out}/data.parquet", resume_state=None,
                        seed=0, engine=engine, ppo_epochs=1, minibatches=1, warmup_steps=0, first_step=0,
                        loss=LossSettings(loss=LossConfig(), kl=KLConfig(), max_tokens=length), critic=None, ptx=None,
                        crash_point="", save_state=False, save_weights=False)
resp = handle(request)
print("RESULT " + json.dumps({"rss": resp["metrics"]["trainer_peak_rss_gib"], "seconds": resp["train_seconds"]}))
"""


def update_in_fresh_process(
    length: int, budget: int, chunked: bool = True, checkpointing: bool = False, total: int = 8192
) -> dict:
    what = (
        f"{total} tokens of {length}-token responses, budget {budget}, logits {'chunked' if chunked else 'at once'}"
        + (", gradient checkpointing" if checkpointing else "")
    )
    out = OUT / what.replace(" ", "_").replace(",", "")
    out.mkdir(parents=True, exist_ok=True)
    flags = ["1" if chunked else "0", "1" if checkpointing else "0", str(total)]
    args = [sys.executable, "-c", SCRIPT, MODEL, str(out), str(length), str(budget), *flags]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"long_memory update ({what}) failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    print(f"long_memory: {what}: peak RSS {result['rss']:.2f} GiB, update {result['seconds']:.1f}s")
    return result


def _row(benchmark: str, baseline: str, base: float, mine: float, unit: str) -> dict:
    return {"benchmark": benchmark, "baseline": baseline, "baseline_value": base, "rlpipe_value": mine, "unit": unit,
            "ratio": mine / base}  # fmt: skip


def run() -> list[dict]:
    short, long_ = update_in_fresh_process(256, 4160, total=32768), update_in_fresh_process(4096, 4160, total=32768)
    kept = update_in_fresh_process(1024, 4096)
    recomputed = update_in_fresh_process(1024, 4096, checkpointing=True)
    whole = update_in_fresh_process(1024, 8192, chunked=False, checkpointing=True)
    chunked = update_in_fresh_process(1024, 8192, checkpointing=True)
    return [
        _row("long_memory_rss", "256-token responses, same budget", short["rss"], long_["rss"],
             "peak RSS GiB (ratio: 4,096-token / 256-token; target ≤ 1.25)"),
        _row("long_memory_checkpointing", "activations kept", kept["rss"], recomputed["rss"],
             "peak RSS GiB (ratio: with gradient checkpointing / without)"),
        _row("long_memory_logit_chunks", "logits at once", whole["rss"], chunked["rss"],
             "peak RSS GiB (ratio: chunked / at once)"),
    ]  # fmt: skip
