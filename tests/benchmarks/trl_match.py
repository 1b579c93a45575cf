"""rlpipe's GRPO and TRL's GRPOTrainer (trl==1.16.0, CPU, HF generate) on the same config, for the end-to-end suites.

Matched settings, all read from the rlpipe config: the task's train prompts, G, prompts per round, max_tokens and
min_tokens, temperature 1, lr with linear warmup then constant, AdamW (0.9, 0.999) without weight decay, grad clip 1,
clip ε, k3 KL to the starting model with β in the loss, the loss aggregation (`--algo grpo`'s seq-mean-token-mean is
TRL's "grpo", token-mean its "dapo"), group-normalised advantages, epochs × minibatches optimizer steps per round, and
the config's reward functions (built-ins or the user's own, same weights and kwargs, called with rlpipe's argument
names) on both sides. Chat-message prompts go to TRL as a conversational dataset (it applies the same chat template).
Every group is trained (rlpipe's dynamic filtering off, as TRL has none).

Each side runs in a new Python process, as a user starts it (`in_fresh_process`: the rlpipe command's iterations; a
script that imports TRL), timed from the moment it is spawned to the end of each round, so that start-up is the same
thing on both sides: the interpreter, the imports and every load (rlpipe: its command's imports and checks, Prefect's
temporary API, vLLM and the DeepSpeed trainer; TRL: torch, transformers, datasets and TRL, the policy and the
reference). Start-up is read as the first round's excess over the later rounds' median. Neither side's exit after its
last round is counted (it is printed).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from tests.benchmarks.bench_iteration import ENGINE_SECONDS


@dataclass
class Training:
    """One side's training: samples and generated tokens trained, the final model, and the clock at the end of each
    round (in the process that trained, time.time(); from `in_fresh_process`, seconds since the process was spawned)."""

    samples: int
    tokens: int
    model: str
    round_ends: list[float] = field(default_factory=list)
    engine_seconds: list[float] = field(
        default_factory=list
    )  # rlpipe: per round, generation and forward/backward passes

    @property
    def wall(self) -> float:
        """Seconds from the start (the spawn) to the end of the last round."""
        return self.round_ends[-1]

    @property
    def startup(self) -> float:
        """The one-off cost: the first round's wall minus the median of the later rounds'."""
        rounds = [b - a for a, b in zip(self.round_ends, self.round_ends[1:])]
        return self.round_ends[0] - statistics.median(rounds)

    @property
    def overhead(self) -> float:
        """The fraction of the rounds after the first spent outside generation and forward/backward passes."""
        rounds = [b - a for a, b in zip(self.round_ends, self.round_ends[1:])]
        return 1.0 - sum(self.engine_seconds[1:]) / sum(rounds)


def run_iterations(config: str, overrides: list[str], run_id: str, iterations: int, algo: str | None = None):
    """(layout, ends): a fresh run of `config` iterated as the rlpipe command runs it (its checks with the engines and
    Prefect's API starting meanwhile, then one flow run per iteration), and time.time() at the end of each iteration."""
    from flows.deployments import prepare_checked_run
    from flows.local_prefect import local_flow_settings
    from flows.rl import rl_iteration
    from schemas.config import load_config
    from storage import RunLayout
    from tasks.engines.resident import close_all

    shutil.rmtree(Path(load_config(config, overrides, algo).storage_root) / run_id, ignore_errors=True)
    ends = []
    try:
        root = prepare_checked_run(
            config, [*overrides, f"rl.iterations={iterations}"], run_id, algo
        )  # engines spawned in it
        with local_flow_settings():  # entered after the checks, as the command does
            for k in range(1, iterations + 1):
                rl_iteration(run_id, k, root)
                ends.append(time.time())
    finally:
        close_all()
    return RunLayout(Path(root), run_id), ends


def rlpipe_training(config: str, overrides: list[str], run_id: str, iterations: int) -> Training:
    """`rlpipe --algo grpo` on `config`, iteration by iteration as the rlpipe command runs them (one flow run each)."""
    from storage import read_stage

    layout, ends = run_iterations(config, overrides, run_id, iterations, "grpo")
    metrics = [read_stage(layout, "train_metrics", k).row(0, named=True) for k in range(1, iterations + 1)]
    tokens = sum(int(read_stage(layout, "rollouts", k)["length"].sum()) for k in range(1, iterations + 1))
    return Training(
        sum(int(m["samples"]) for m in metrics),
        tokens,
        str(layout.checkpoint_dir(iterations)),
        ends,
        [sum(m[c] for c in ENGINE_SECONDS) for m in metrics],
    )


def trl_training(config: str, overrides: list[str], out: Path, iterations: int) -> Training:
    """TRL's GRPOTrainer with the config's settings (see the module docstring), from the config's model.path."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from schemas.config import load_config
    from tasks.data.example_tasks import ensure_task_files
    from tasks.rewards.loader import accepted_arguments, load_function, specs_from_config

    cfg = load_config(config, overrides, "grpo")
    train = pl.read_parquet(ensure_task_files(cfg.task)["train"])
    r, o, kl = cfg.rollout, cfg.optim, cfg.kl
    assert cfg.advantage.estimator == "grpo" and kl.placement == "loss" and kl.estimator == "k3" and not o.weight_decay
    loss_type = {"seq-mean-token-mean": "grpo", "token-mean": "dapo"}[cfg.loss.aggregation]
    shutil.rmtree(out, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    eos, generated = tokenizer.eos_token_id, {"tokens": 0}

    def reward_func(name, spec):
        fn = load_function(spec)
        accepted = accepted_arguments(fn)

        def score(prompts, completions, completion_ids, answer, **_):
            if name == next(iter(cfg.reward.functions)):  # once per generation batch
                generated["tokens"] += sum(len(ids) for ids in completion_ids)
            out = []
            for c, a, ids in zip(completions, answer, completion_ids):
                text = c[0]["content"] if isinstance(c, list) else c  # conversational: [{"role": "assistant", ...}]
                # rlpipe's arguments: "stop" only when it emitted EOS; the response's length and the limit
                args = {
                    "response": text,
                    "ground_truth": a,
                    "finish_reason": "stop" if eos in ids else "length",
                    "length": len(ids),
                    "max_tokens": r.max_tokens,
                }
                out.append(
                    float(fn(**{k: v for k, v in args.items() if accepted is None or k in accepted}, **spec.kwargs))
                )
            return out

        score.__name__ = name
        return score

    class RoundClock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **_):
            if state.global_step % (o.minibatches * o.ppo_epochs) == 0:
                self.ends.append(time.time())

    samples_per_round = r.prompts_per_round * r.group_size
    args = GRPOConfig(
        output_dir=str(out.parent / f"{out.name}-trainer"),
        use_cpu=True,
        seed=cfg.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=o.minibatches * o.ppo_epochs,
        learning_rate=o.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=o.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=o.grad_clip,
        per_device_train_batch_size=samples_per_round // o.minibatches,
        gradient_accumulation_steps=1,
        steps_per_generation=o.minibatches,
        num_iterations=o.ppo_epochs,
        num_generations=r.group_size,
        max_completion_length=r.max_tokens,
        generation_kwargs={"min_new_tokens": r.min_tokens} if r.min_tokens else None,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0,
        beta=kl.beta,
        epsilon=cfg.loss.clip_eps_low,
        epsilon_high=cfg.loss.clip_eps_high,
        loss_type=loss_type,
        scale_rewards="group",
        max_steps=iterations * o.minibatches * o.ppo_epochs,
        reward_weights=[f.weight for f in cfg.reward.functions.values()],
        remove_unused_columns=False,
        bf16=False,
        dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict({"prompt": train["prompt"].to_list(), "answer": train["answer"].to_list()})
    clock = RoundClock()
    specs = specs_from_config(cfg.reward)
    trainer = GRPOTrainer(
        model=cfg.model.path,
        reward_funcs=[reward_func(n, specs[n]) for n in cfg.reward.functions],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    trainer.save_model(str(out))
    tokenizer.save_pretrained(out)
    return Training(iterations * samples_per_round, generated["tokens"], str(out), clock.ends)


def in_fresh_process(side: str, config: str, overrides: list[str], name: str, iterations: int) -> Training:
    """`side` ("rlpipe", or "trl") trained in a new Python process (this module run as a script), its round ends in
    seconds from the moment it was spawned. `name`: rlpipe's run id, or TRL's output folder."""
    result = Path("runs/bench") / f"{side}-{Path(name).name}.result.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    spawned = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.benchmarks.trl_match",
            side,
            json.dumps([config, overrides, name, iterations]),
            str(result),
        ],
        check=True,
    )
    exited = time.time() - spawned
    training = Training(**json.loads(result.read_text()))
    training.round_ends = [t - spawned for t in training.round_ends]
    print(
        f"{side}: last round ended {training.wall:.1f}s after its process was spawned, the process exited at "
        f"{exited:.1f}s"
    )
    return training


def main(side: str, args: str, result: str) -> None:
    config, overrides, name, iterations = json.loads(args)
    if side == "rlpipe":
        import flows.cli  # noqa: F401  (first, as in the rlpipe command: Prefect's settings and its API's database)

        training = rlpipe_training(config, overrides, name, iterations)
    else:
        training = trl_training(config, overrides, Path(name), iterations)
    Path(result).write_text(json.dumps(dataclasses.asdict(training)))


if __name__ == "__main__":  # in_fresh_process
    main(*sys.argv[1:])
