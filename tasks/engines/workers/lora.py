"""LoRA adapters (peft) on the policy: how a model folder becomes a trainable model, and what an adapter checkpoint is.

An adapter checkpoint is a PEFT folder: `adapter_config.json` (its `base_model_name_or_path` is the absolute path of the
base model, which never changes during a run) and `adapter_model.safetensors`, plus the base model's `config.json` (so
the folder identifies itself as a model like any other checkpoint), the tokenizer and the sync probe. vLLM loads the
adapter on top of the base model it started with; transformers loads it through `load_causal_lm`.
No Prefect import: this runs in the worker processes (and in `rlpipe export --merge`).
Imports: peft (4.5 s of imports) and transformers are imported inside functions: the stages import this module for its
config checks and descriptions.
"""

from __future__ import annotations

import json
import os
import shutil

from schemas.errors import UserError
from schemas.requests import LoraSettings

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoraError(UserError, ValueError):
    pass


def is_adapter(path) -> bool:
    return os.path.exists(os.path.join(path, ADAPTER_CONFIG))


def adapter_base(path) -> str:
    """The base model folder an adapter checkpoint was trained on."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        return json.load(f)["base_model_name_or_path"]


def peft_config(lora: LoraSettings):
    from peft import LoraConfig

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def _plain(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.abspath(path), dtype=getattr(torch, dtype))


def load_causal_lm(path: str, dtype: str = "float32", lora: LoraSettings | None = None, trainable: bool = False):
    """The causal LM in `path`: a plain model folder, or an adapter checkpoint on its base model. With `lora` and
    `trainable`, a plain folder gets a new adapter, initialised from `lora.seed` (B = 0, so it starts as the base
    model); an adapter checkpoint keeps its own adapter. Only the adapter (and `modules_to_save`) then requires a
    gradient."""
    import torch
    from peft import PeftModel, get_peft_model

    if is_adapter(path):
        return PeftModel.from_pretrained(
            _plain(adapter_base(path), dtype), os.path.abspath(path), is_trainable=trainable
        )
    model = _plain(path, dtype)
    if not (lora and trainable):
        return model
    with torch.random.fork_rng(devices=[]):  # the adapter's init from its own seed, whatever ran before
        torch.manual_seed(lora.seed)
        try:
            return get_peft_model(model, peft_config(lora))
        except ValueError as err:  # peft names the modules it did not find
            raise LoraError(
                f"lora.target_modules does not fit the model in {path}: {str(err).splitlines()[0]}"
            ) from None


def is_peft(model) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def base_path_of(model) -> str | None:
    """The base model folder of a peft model (None for a plain model)."""
    if not is_peft(model):
        return None
    return os.path.abspath(model.peft_config["default"].base_model_name_or_path)


def save_adapter(model, out_dir: str, state_dict=None) -> None:
    """The adapter as a PEFT folder, plus the base model's config.json (the checkpoint then reads as a model folder)."""
    model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
    shutil.copy(os.path.join(base_path_of(model), "config.json"), os.path.join(out_dir, "config.json"))


def save_model_config(model, out_dir: str) -> None:
    """What a checkpoint holds of its model without the weights: the config (and generation config) of a plain model;
    the adapter's config and the base model's config.json for an adapter. The folder still reads as a model of its
    kind (is_adapter, its architecture); `has_weight_files` tells it has no weights."""
    os.makedirs(out_dir, exist_ok=True)
    if is_peft(model):
        model.peft_config["default"].save_pretrained(out_dir)
        shutil.copy(os.path.join(base_path_of(model), "config.json"), os.path.join(out_dir, "config.json"))
        return
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out_dir)


def adapter_stats(model) -> dict[str, float]:
    """The number of trainable parameters and their L2 norm (the adapter's, and modules_to_save')."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.sqrt(sum((p.detach().float() ** 2).sum() for p in params)) if params else torch.tensor(0.0)
    return {"trainable_params": float(sum(p.numel() for p in params)), "adapter_norm": float(norm)}


def describe(path: str) -> dict:
    """What the optimize manifest records of an adapter checkpoint: rank, alpha, targets, saved modules, its bytes."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    targets, weights = cfg.get("target_modules"), os.path.join(path, ADAPTER_WEIGHTS)
    return {
        "rank": cfg["r"],
        "alpha": cfg["lora_alpha"],
        "target_modules": sorted(targets) if isinstance(targets, list) else targets,
        "modules_to_save": cfg.get("modules_to_save") or [],
        "base_model": cfg["base_model_name_or_path"],
        # None for a checkpoint written without its weight files (engines.weight_sync collective)
        "adapter_bytes": os.path.getsize(weights) if os.path.exists(weights) else None,
    }


def merge_into_folder(adapter_dir: str, dest: str) -> None:
    """The adapter merged into its base model's weights, saved as a plain Hugging Face folder (no peft needed to load
    it) with the checkpoint's tokenizer and the sync probe."""
    from transformers import AutoTokenizer

    model = load_causal_lm(adapter_dir).merge_and_unload()
    model.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(dest)
    base = adapter_base(adapter_dir)
    if os.path.exists(os.path.join(base, "generation_config.json")):
        shutil.copy(os.path.join(base, "generation_config.json"), dest)


def check_targets(model_path: str, lora) -> None:
    """A one-line error when lora.target_modules names a module the model does not have, checked on the model's
    architecture built without weights (the meta device: no memory, no load)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if lora.target_modules == "all-linear" and not lora.modules_to_save:
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    names = [n for n, _ in model.named_modules()]
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    wanted = [] if lora.target_modules == "all-linear" else [("target_modules", t, linear) for t in lora.target_modules]
    for key, name, pool in wanted + [("modules_to_save", t, names) for t in lora.modules_to_save]:
        if not any(n == name or n.endswith("." + name) for n in pool):
            kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
            raise LoraError(
                f"lora.{key}: the model in {model_path} has no {'linear ' if key == 'target_modules' else ''}module "
                f"named {name!r} (its linear layers: {', '.join(kinds)})"
            )
