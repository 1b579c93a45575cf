"""The resident trainer's optimizer state written after its answer (tasks/engines/workers/deferred_state.py): published
into the checkpoint only once the checkpoint is committed and the state complete, equal to the engine's own with the
weights loaded from the checkpoint's HF files (the state holds no second copy), dropped for a checkpoint that was never
committed, and a writer's failure reported by `finish`.
The engines run in a fresh interpreter: DeepSpeed's process group must not outlive the test in pytest's process."""

import json
import subprocess
import sys

SCRIPT = """
import json, os, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from schemas.requests import EngineSettings
from pathlib import Path
from storage import state_dir_for
from tasks.engines.workers.deferred_state import DeferredState
from tasks.engines.workers.engine_cache import read_state_id, state_pending, write_state_id
from tasks.engines.workers.training import deepspeed_engine

root = sys.argv[1]
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=32)
settings = EngineSettings(zero_stage=0, lr=1e-3, weight_decay=0.0, grad_clip=1.0, micro_batch_size=2, dtype="float32",
                          gradient_checkpointing=False, lora=None)
engine, _ = deepspeed_engine(LlamaForCausalLM(cfg), settings, gas=1)
ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8]])
engine.backward(engine(input_ids=ids, labels=ids).loss)
engine.step()
out = {}

committed = os.path.join(root, "iter=00001")
engine.module.save_pretrained(committed + ".tmp")  # the weights: what a resume loads the model from
sid = write_state_id(committed + ".tmp", pending=True)
deferred = DeferredState()
deferred.start([("", engine, sid)], committed)
os.rename(committed + ".tmp", committed)  # the caller commits while the state is written
out["pending_before_finish"] = state_pending(committed)
out["seconds"] = deferred.finish()
out["pending_after"] = state_pending(committed)
out["same_id"] = read_state_id(committed) == sid
out["staging_left"] = state_dir_for(Path(committed)).exists()
saved = torch.load(os.path.join(committed, "ds_state", "state", "mp_rank_00_model_states.pt"), weights_only=False)
out["module_in_state"] = len(saved["module"])  # the weights are not written twice
resumed = LlamaForCausalLM.from_pretrained(committed)
fresh, _ = deepspeed_engine(resumed, settings, gas=1, resume_state=os.path.join(committed, "ds_state"))
mine, theirs = engine.optimizer.state_dict()["state"], fresh.optimizer.state_dict()["state"]
out["moments_equal"] = all(
    torch.equal(mine[k]["exp_avg_sq"], theirs[k]["exp_avg_sq"]) and mine[k]["exp_avg_sq"].abs().sum() > 0 for k in mine
)
out["weights_equal"] = all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), fresh.module.parameters()))

never = os.path.join(root, "iter=00002")  # the caller failed before its commit
deferred.start([("", engine, "x")], never)
deferred.finish()
out["uncommitted_left"] = os.path.exists(never) or state_dir_for(Path(never)).exists()

class Broken:
    module = engine.module
    def zero_optimization_stage(self):
        return 0
    def save_checkpoint(self, *a, **k):
        raise OSError("No space left on device")

deferred.start([("", Broken(), "y")], os.path.join(root, "iter=00003"))
try:
    deferred.finish()
    out["error"] = None
except RuntimeError as exc:
    out["error"] = str(exc)
print(json.dumps(out))
"""


def test_the_optimizer_state_is_published_after_the_commit_and_only_then(tmp_path):
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["pending_before_finish"] and not out["pending_after"] and out["same_id"]
    assert out["seconds"] is not None and not out["staging_left"]
    assert out["moments_equal"] and out["weights_equal"]  # what a resume loads is the engine's own state
    assert out["module_in_state"] == 0
    assert not out["uncommitted_left"]
    assert "iter=00003" in out["error"] and "No space left on device" in out["error"]
