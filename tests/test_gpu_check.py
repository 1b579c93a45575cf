"""The device check (infra/gpu_check.py) on its CPU path, as docs/operations.md describes running it, and its FLOP
count against a hand count."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "infra/gpu_check.py"


@pytest.mark.long
def test_device_check_on_the_cpu_writes_its_report(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["device"] == "cpu" and report["peak"]["bf16_flops_per_s"] > 0
    fp32, bf16 = report["equality"]["float32"], report["equality"]["bfloat16"]
    # float32 on the CPU in two processes: the same bytes (the tiny model is bit-reproducible on a fixed thread count).
    assert fp32["logprob_max_abs"] == 0 and fp32["grad_rel"] == 0 and fp32["update_rel"] == 0
    # bfloat16 is really another precision: not equal, within its stated bounds.
    assert 0 < bf16["logprob_mean_abs"] <= bf16["tolerance"]["logprob_mean_abs"]
    assert 0 < bf16["grad_rel"] <= bf16["tolerance"]["grad_rel"] and bf16["agree"] >= bf16["tolerance"]["agree"]
    tp = report["throughput"]["tiny"]
    assert tp["tokens"] > 0 and tp["tokens_per_s"] > 0 and 0 < tp["mfu"] < 1
    assert report["weight_send"]["run"] is False and "vLLM's weight-transfer API" in report["weight_send"]["why"]
    assert "equality float32" in proc.stdout and "throughput tiny" in proc.stdout  # the summary table, printed last


def test_cuda_without_a_gpu_is_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "no GPU" in proc.stderr


def test_train_flops_by_hand():
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_check_steps import train_flops

    config = SimpleNamespace(
        hidden_size=8,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        vocab_size=100,
        head_dim=4,
    )
    counts = {"update_tokens": 10, "update_attention_pairs": 30, "update_logit_positions": 6}
    # Per layer and token: q and o 2·8·8 = 128, k and v 2·8·4 = 64, MLP 3·8·16 = 384 multiply-adds: 576.
    # Forward: 2·2·576·10 = 23,040; attention 2·2·2·(2·4)·30 = 1,920; logits 2·8·100·6 = 9,600; ×3 for the backward.
    assert train_flops(config, counts) == 3 * (23_040 + 1_920 + 9_600)
