"""The sampler's weights, in its vLLM engine (tasks/engines/workers/vllm_generate.py): a checkpoint's files reloaded
in place (tied embeddings re-packed), a LoRA adapter loaded in place of the last, and the probe that checks after a
sync that the sampler's logprobs are the trainer's (tasks/engines/workers/sync_probe.py). vLLM is imported inside the
functions, as in the engine's module.
"""

from __future__ import annotations

import os
import shutil


def _refresh_lm_head(worker) -> None:
    """The tied output layer re-packed after an in-place reload (weight_transfer.refresh_lm_head), in a worker."""
    from tasks.engines.workers.weight_transfer import refresh_lm_head

    refresh_lm_head(worker.model_runner.get_model())


def require_weight_files(model_path: str) -> None:
    from storage import has_weight_files

    if not has_weight_files(model_path):
        raise ValueError(
            f"{model_path} holds no weight files (a checkpoint the trainer sends over a process group, "
            "engines.weight_sync: collective): the sampler cannot load it from disk"
        )


def sync_weights(llm, model_path: str) -> None:
    """The weights of a checkpoint's files, reloaded in place."""
    require_weight_files(model_path)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": model_path})
    llm.collective_rpc(_refresh_lm_head)
    llm.reset_prefix_cache()


class Adapters:
    """The LoRA adapter the engine samples with: a checkpoint's adapter is loaded once (its bytes, not the model's),
    the previous one dropped; the engine's own weights (the base model) never change."""

    def __init__(self, llm, base_path: str):
        self.llm, self.base, self.next_id, self.current = llm, os.path.abspath(base_path), 1, None

    def request_for(self, model_path: str):
        """The LoRARequest for an adapter checkpoint (loaded now), or None for the base model itself."""
        from tasks.engines.workers.lora import is_adapter

        if not is_adapter(model_path):
            if os.path.abspath(model_path) != self.base:
                raise ValueError(f"{model_path} is neither this engine's base model ({self.base}) nor an adapter on it")
            return None
        self._check_base(model_path)
        require_weight_files(model_path)
        return self._load(os.path.abspath(model_path))

    def received(self, folder: str, model_path: str):
        """The LoRARequest for an adapter received from the trainer into `folder` (removed once loaded)."""
        self._check_base(model_path)
        try:
            return self._load(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _check_base(self, model_path: str) -> None:
        from tasks.engines.workers.lora import adapter_base

        if os.path.abspath(adapter_base(model_path)) != self.base:
            raise ValueError(
                f"the adapter in {model_path} is on {adapter_base(model_path)}, and this engine runs {self.base}"
            )

    def _load(self, folder: str):
        """Load the adapter in `folder` now (vLLM reads its files at once), in place of the current one."""
        from vllm.lora.request import LoRARequest

        if self.current is not None:
            self.llm.llm_engine.remove_lora(self.current.lora_int_id)
        self.current = None  # a load that fails halfway leaves no adapter named
        request = LoRARequest(f"adapter{self.next_id}", self.next_id, folder)
        self.next_id += 1
        self.llm.llm_engine.add_lora(request)
        self.current = request
        return request


def sampler_probe_gap(llm, model_path: str, lora=None) -> float | None:
    """Mean |log π_sampler − log π_trainer| on the checkpoint's probe sequences (tasks/engines/workers/sync_probe.py);
    None for a model folder without a probe (one a trainer of ours did not write)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tasks.engines.workers.sync_probe import mean_abs_gap, read_probe

    probe = read_probe(model_path)
    if probe is None:
        return None
    if llm.llm_engine.vllm_config.lora_config is not None:
        return mean_abs_gap(_forced_logprobs(llm, probe["token_ids"], lora), probe["logprobs"])
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in probe["token_ids"]], params, use_tqdm=False)
    # prompt_logprobs[t] (t ≥ 1) maps the prompt's own token t to its logprob given the tokens before it.
    sampler = [
        [step[tok].logprob for step, tok in zip(o.prompt_logprobs[1:], ids[1:])]
        for o, ids in zip(outs, probe["token_ids"])
    ]
    return mean_abs_gap(sampler, probe["logprobs"])


def _forced_logprobs(llm, sequences: list[list[int]], lora) -> list[list[float]]:
    """log π(seq[t] | seq[:t]) for t ≥ 1, one request per position: the prefix as the prompt, the next token the only
    one allowed, and its logprob taken before that restriction (vLLM reports the raw model's logprobs). With LoRA
    enabled vLLM-CPU cannot compute prompt_logprobs (its LoRA logits kernel is indexed per request, not per prompt
    position)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    positions = [(seq[:t], seq[t]) for seq in sequences for t in range(1, len(seq))]
    params = [
        SamplingParams(max_tokens=1, logprobs=0, temperature=1.0, allowed_token_ids=[tok]) for _, tok in positions
    ]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p, _ in positions], params, use_tqdm=False, lora_request=lora
    )
    flat = [o.outputs[0].logprobs[0][tok].logprob for o, (_, tok) in zip(outs, positions)]
    out, at = [], 0
    for seq in sequences:
        out.append(flat[at : at + len(seq) - 1])
        at += len(seq) - 1
    return out
