"""The model recipe: a character tokenizer over the task alphabet and a small Llama from a YAML config.

Writes ordinary Hugging Face format (safetensors + tokenizer files), so everything downstream loads it with
`from_pretrained(path)`, exactly as it would load a real local model.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tasks.data.arithmetic import ALPHABET

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_tokenizer(alphabet: str = ALPHABET):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *dict.fromkeys(alphabet)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()  # join characters back without spaces
    core.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left", model_max_length=4096,
    )


def init_model(recipe_path: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Build the tokenizer and a randomly initialised causal LM from the recipe; return the output folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and not force:
        return out_dir
    recipe = yaml.safe_load(Path(recipe_path).read_text())
    if recipe.pop("architecture", "llama") != "llama":
        raise ValueError(f"{recipe_path}: only the llama architecture is supported by the recipe")
    seed = recipe.pop("init_seed", 0)
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, dtype="float32", **recipe,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out_dir.exists():
        import shutil

        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir
