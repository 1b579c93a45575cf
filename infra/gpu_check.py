"""The device check: rlpipe's trainer worker on one accelerator, against its own CPU float32 result, and how fast.

    python3 infra/gpu_check.py --device cuda --out gpu_check.json      # on a GPU machine (docs/operations.md)
    python3 infra/gpu_check.py --device cpu --out gpu_check.json       # the same steps on the CPU (make test runs it)

It needs torch, transformers, DeepSpeed, pydantic and polars, nothing else (no vLLM, Ray or Prefect), so it runs on a
bare CUDA machine with the wheels it carries (`make gpu-check-wheels`). Models are built here with random weights in
the shapes of the demo's SmolLM2-135M and of Qwen2.5-0.5B: a real model's weights are too large to carry (64 MiB).

Three measurements, each step in its own process (a fresh process group and device state; the steps themselves are
infra/gpu_check_steps.py's, this script builds their inputs, compares and reports), one JSON file at the end:
- `equality`: one batch of groups through the trainer's own code (token_batch.batched_responses for the logprobs,
  policy_update.PolicyUpdate.micro_step for the loss, DeepSpeed's step for one update) on the device in float32 and in
  bfloat16, and on the CPU in float32; the device's logprobs, loss, gradient and weight update against the CPU's.
- `throughput`: tokens/s of the update (forward, backward, optimizer step; bfloat16 on a GPU) at both shapes, and the
  model FLOP utilisation against the card's bfloat16 matrix-product peak, measured in the same run (`peak`).
- `weight_send`: not run: the sync goes through vLLM's weight-transfer API (tasks/engines/workers/weight_transfer.py
  and weight_transfer_trainer.py), both of whose sides are vLLM's code, and vLLM is not on such a machine (its CUDA
  wheel is several times the 64 MiB a bare machine can be sent); tests/test_weight_sync.py runs the API here on the
  CPU.
A step that fails is recorded with its error and the others still run; the exit status is non-zero if any failed or
any tolerance was missed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Model shapes (transformers model_type, config). Random weights: the numbers below are the architectures' own.
SHAPES = {
    "smollm2-135m": (  # the demo's model (infra/model/smollm2_135m_instruct.yaml)
        "llama",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            vocab_size=49152,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            tie_word_embeddings=True,
        ),
    ),
    "tiny": (  # --device cpu's stand-in, so that the test takes seconds
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        ),
    ),
}

# Tolerances of the device against the CPU in float32, per quantity, and why:
# - float32 (TF32 off): the same function, summed in another order: logprobs agree to ~1e-5 absolute, the loss and
#   the gradient to ~1e-5 relative; 1e-3 and 1e-3 leave room for 30 layers of reordering.
# - bfloat16 (8 significant bits, 2^-9 ≈ 2e-3 relative per rounding, accumulated over the layers): logprobs within
#   0.05 on average and 1.0 at worst, the loss within 2e-2 and the gradient within 0.1 relative, which is what
#   bfloat16 training gives and what the sampler-vs-trainer gap of a bfloat16 run shows anyway.
# The update is Adam's first step, lr × g/(|g| + ε), close to lr × sign(g): weights whose gradient is near zero may
# flip sign under any rounding, so the update's relative difference is reported, with a bound only on its median
# agreement (the fraction of weights that moved the same way).
TOLERANCE = {
    "float32": {"logprob_max_abs": 1e-3, "logprob_mean_abs": 1e-4, "loss_rel": 1e-3, "grad_rel": 1e-3, "agree": 0.99},
    "bfloat16": {"logprob_max_abs": 1.0, "logprob_mean_abs": 0.05, "loss_rel": 2e-2, "grad_rel": 0.1, "agree": 0.9},
}


def build_model(shape: str, out_dir: Path, seed: int = 0) -> Path:
    """A random model of `shape` saved in Hugging Face format with a character tokenizer (only its pad id is read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tasks.data.model_recipe import char_tokenizer

    arch, kwargs = SHAPES[shape]
    tok = char_tokenizer()
    config = AutoConfig.for_model(arch, pad_token_id=tok.pad_token_id, dtype="float32", **kwargs)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def training_rows(vocab: int, groups: int, samples: int, prompt_len: int, max_response: int, seed: int = 0):
    """A group-structured training frame of random tokens: responses of mixed lengths (a long tail, as long reasoning
    gives), advantages of mean zero within each group, π_old a fixed random-walk (the ratio is then ≠ 1 somewhere)."""
    import random

    rnd = random.Random(seed)
    rows = []
    for _ in range(groups):
        prompt = [rnd.randrange(4, vocab) for _ in range(prompt_len)]
        advantages = [rnd.gauss(0, 1) for _ in range(samples)]
        mean = sum(advantages) / samples
        for a in advantages:
            n = rnd.choice([max(1, max_response // k) for k in (32, 8, 4, 2, 1)])
            rows.append(
                {
                    "prompt_token_ids": prompt,
                    "token_ids": [rnd.randrange(4, vocab) for _ in range(n)],
                    "old_logprobs": [-rnd.uniform(9.0, 12.0) for _ in range(n)],
                    "ref_logprobs": [-rnd.uniform(9.0, 12.0) for _ in range(n)],
                    "token_advantages": [a - mean] * n,
                    "loss_mask": 1.0,
                }
            )
    return rows


def measure_peak(device: str) -> dict:
    """The bfloat16 matrix-product rate of this device: an 8192³ product on a GPU (1024³ on a CPU), median of ten."""
    import torch

    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for i in range(13):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:  # three warm-ups
            times.append(time.perf_counter() - t0)
    return {"n": n, "bf16_flops_per_s": 2 * n**3 / sorted(times)[len(times) // 2]}


def compare(ref: dict, got: dict, dtype: str) -> dict:
    import torch

    diffs = torch.cat([(a.float() - b.float()).abs() for a, b in zip(got["logprobs"], ref["logprobs"])])
    g, gr = got["grad"], ref["grad"]
    d, dr = got["delta"], ref["delta"]
    moved = dr != 0
    out = {
        "logprob_max_abs": float(diffs.max()),
        "logprob_mean_abs": float(diffs.mean()),
        "loss": got["loss"],
        "loss_rel": abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12),
        "grad_rel": float((g - gr).norm() / gr.norm()),
        "update_rel": float((d - dr).norm() / dr.norm()),
        "agree": float((torch.sign(d[moved]) == torch.sign(dr[moved])).float().mean()),
    }
    bounds = TOLERANCE[dtype]
    failed = [k for k, bound in bounds.items() if (out[k] < bound if k == "agree" else out[k] > bound)]
    return {**out, "tolerance": bounds, "within": not failed, "missed": failed}


def _child(step: str, device: str, dtype: str, work: Path, **extra) -> dict:
    """Run one step in a fresh process; its dict, or {"error": last line of its output}."""
    result = work / f"{step}-{device}-{dtype}-{extra.get('shape', '')}"  # .json: the dict; .pt: the tensors
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if device == "cpu":  # the CPU reference on a GPU machine: DeepSpeed and torch must not see the GPU
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, __file__, "--step", step, "--device", device, "--dtype", dtype, "--result", str(result)]
    for key, value in extra.items():
        cmd += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    if proc.returncode != 0:
        lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
        errors = [x for x in lines if "Error" in x or "Exception" in x] or lines or [f"exit {proc.returncode}"]
        return {"error": errors[-1].removeprefix("[rank0]: "), "log_tail": lines[-15:]}
    return json.loads(Path(f"{result}.json").read_text())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--step", choices=["equality", "throughput"], help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=4096, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help=argparse.SUPPRESS)
    p.add_argument("--shape", default="", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help="profile one more update step of each throughput shape")
    return p.parse_args(argv)


def environment(device: str) -> dict | None:
    """Where and when the check runs: the device and the libraries' versions; None, with one line on stderr, when
    DeepSpeed or transformers is missing."""
    import torch

    report: dict = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import deepspeed
        import transformers

        report.update(deepspeed=deepspeed.__version__, transformers=transformers.__version__)
    except ImportError as exc:
        print(f"gpu_check: {exc} (install the carried wheels first: docs/operations.md)", file=sys.stderr)
        return None
    return report


def check_equality(device: str, work: Path) -> tuple[dict, bool]:
    """The demo's shape on a GPU (the tiny one on a CPU), one batch, three runs: the device in float32 and in bfloat16
    against the CPU in float32; (the comparisons, whether every run ran within its tolerances)."""
    import torch

    gpu, ok = device == "cuda", True
    shape = "smollm2-135m" if gpu else "tiny"
    model = build_model(shape, work / shape)
    vocab = SHAPES[shape][1]["vocab_size"]
    rows = training_rows(vocab, groups=4, samples=4, prompt_len=32, max_response=256 if gpu else 64)
    (work / "eq_rows.json").write_text(json.dumps(rows))
    common = dict(model=model, rows=work / "eq_rows.json", budget=2048)
    runs = {"cpu-float32": _child("equality", "cpu", "float32", work, **common)}
    for dtype in ("float32", "bfloat16"):
        runs[f"{device}-{dtype}"] = _child("equality", device, dtype, work, **common)
    equality: dict = {"shape": shape, "rows": len(rows), "tokens": sum(len(r["token_ids"]) for r in rows)}
    ref_path = work / "equality-cpu-float32-.pt"
    for dtype in ("float32", "bfloat16"):
        name = f"{device}-{dtype}"
        if "error" in runs[name] or "error" in runs["cpu-float32"]:
            equality[dtype] = runs[name] if "error" in runs[name] else runs["cpu-float32"]
            ok = False
            continue
        got = torch.load(work / f"equality-{device}-{dtype}-.pt", weights_only=False)
        equality[dtype] = compare(torch.load(ref_path, weights_only=False), got, dtype)
        ok = ok and equality[dtype]["within"]
    return equality, ok


def check_throughput(device: str, work: Path, peak: dict, profile: bool) -> tuple[dict, bool]:
    """The update in bfloat16 on a GPU (float32 on a CPU, whose bfloat16 is emulated), both shapes (the tiny one on a
    CPU); (a row per shape, whether every shape ran)."""
    gpu, ok = device == "cuda", True
    throughput = {}
    dtype = "bfloat16" if gpu else "float32"
    for shape in ("smollm2-135m", "qwen2.5-0.5b") if gpu else ("tiny",):
        model = build_model(shape, work / shape)
        vocab = SHAPES[shape][1]["vocab_size"]
        rows = training_rows(
            vocab,
            groups=16 if gpu else 2,
            samples=8 if gpu else 2,
            prompt_len=128,
            max_response=4096 if gpu else 64,  # responses of 128 to 4,096 tokens on a GPU
        )
        path = work / f"tp_rows_{shape}.json"
        path.write_text(json.dumps(rows))
        row = _child(
            "throughput",
            device,
            dtype,
            work,
            shape=shape,
            model=model,
            rows=path,
            budget=16384,
            steps=3 if gpu else 1,
            **({"profile": True} if profile else {}),
        )
        if "error" not in row:
            row["mfu"] = row["flops_per_s"] / peak["bf16_flops_per_s"]
        else:
            ok = False
        throughput[shape] = {"dtype": dtype, **row}
    return throughput, ok


def print_profiles(throughput: dict) -> None:
    """Each profiled shape's operator tables printed, out of its row; the profile's figures stay in it."""
    for shape, row in throughput.items():
        prof = row.pop("profile", {})
        for kind in ("device", "host"):
            if kind in prof:
                print(f"--- {shape}: the most {kind} time\n{prof.pop(kind)}")
        if prof:
            row["profile"] = prof
            print(f"--- {shape}: {prof}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.step:  # a child
        from gpu_check_steps import run_equality, run_throughput

        out = (run_equality if args.step == "equality" else run_throughput)(args)
        Path(args.result + ".json").write_text(json.dumps(out))
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda, but torch sees no GPU (use --device cpu)", file=sys.stderr)
        return 2
    t_start = time.time()
    report = environment(args.device)
    if report is None:
        return 2
    report["peak"] = measure_peak(args.device)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        if not args.profile:  # --profile: the throughput steps only
            report["equality"], ok = check_equality(args.device, Path(tmp))
        report["throughput"], ran = check_throughput(args.device, Path(tmp), report["peak"], args.profile)
        ok = ok and ran
    report["weight_send"] = {
        "run": False,
        "why": "the weight sync is vLLM's weight-transfer API, both sides vLLM's code, and vLLM is not on this machine "
        "(its wheel is far over what a bare machine is sent); tests/test_weight_sync.py runs it on the CPU",
    }
    print_profiles(report["throughput"])
    report["seconds"] = round(time.time() - t_start, 1)
    report["ok"] = ok
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(summary(report))
    return 0 if ok else 1


def summary(report: dict) -> str:
    peak = report["peak"]["bf16_flops_per_s"] / 1e12
    lines = [f"{report['device']}  torch {report['torch']}  peak bf16 {peak:.1f} TFLOP/s"]
    for dtype, row in report.get("equality", {}).items():
        if isinstance(row, dict) and "logprob_max_abs" in row:
            lines.append(
                f"equality {dtype:9s} logprob max {row['logprob_max_abs']:.2e} mean {row['logprob_mean_abs']:.2e}  "
                f"loss {row['loss_rel']:.2e}  grad {row['grad_rel']:.2e}  update {row['update_rel']:.2e}  "
                f"agree {row['agree']:.4f}  {'ok' if row['within'] else 'MISSED ' + ','.join(row['missed'])}"
            )
        elif isinstance(row, dict) and "error" in row:
            lines.append(f"equality {dtype}: FAILED {row['error']}")
    for shape, row in report.get("throughput", {}).items():
        if "error" in row:
            lines.append(f"throughput {shape}: FAILED {row['error']}")
        else:
            lines.append(
                f"throughput {shape} {row['dtype']}: {row['tokens_per_s']:,.0f} tokens/s  "
                f"{row['flops_per_s'] / 1e12:.1f} TFLOP/s  MFU {row['mfu']:.3f}  peak mem {row['peak_gpu_gib']} GiB"
            )
    lines.append(f"{'ok' if report['ok'] else 'NOT OK'} in {report['seconds']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
