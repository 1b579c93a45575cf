"""Model recipes: build a small causal LM and its tokenizer offline, from a YAML file (`rlpipe init-model`).

    architecture: qwen2          # any transformers model_type: llama, qwen2, mistral, gpt2, ...
    tokenizer:
      kind: bpe                  # char: one token per character of `alphabet`; bpe: byte-level BPE trained on `corpus`
      vocab_size: 512
      corpus: [data/train.parquet]   # Parquet/JSONL files (globs): every string in them, chat messages included
      chat_template: chatml      # chatml, or a Jinja template of your own; none for a base model
    init_seed: 0
    hidden_size: 128             # everything else goes to the architecture's config
    ...

Writes ordinary Hugging Face format (safetensors + tokenizer files), so everything downstream loads it with
`from_pretrained(path)`, exactly as it loads a user's own model folder. Nothing is downloaded.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import yaml
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from schemas.errors import UserError
from tasks.data.datasets import read_file, resolve_files

DEMO_ALPHABET = "0123456789+-*="  # the demo's character tokenizer when a recipe names none
CHAR_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2 writes it; the generation prompt opens the assistant's turn, which ends with <|im_end|> (EOS).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class RecipeError(UserError, ValueError):
    pass


def char_tokenizer(alphabet: str = DEMO_ALPHABET):
    """One token per character of `alphabet`, a BOS on every encoded text, decoded without spaces."""

    vocab = {tok: i for i, tok in enumerate([*CHAR_SPECIALS, *dict.fromkeys(alphabet)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    core.decoder = decoders.Fuse()  # join characters back without spaces
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=4096,
    )


def corpus_strings(patterns: list[str]):
    """Every string value in the corpus files, nested ones (chat messages, structs) included."""

    def walk(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from walk(v)
        elif isinstance(value, list):
            for v in value:
                yield from walk(v)

    for path in resolve_files(patterns, "tokenizer.corpus"):  # files of any columns
        for row in read_file(path).iter_rows():
            for value in row:
                yield from walk(value)


def bpe_tokenizer(vocab_size: int, corpus: list[str], chat_template: str | None):
    """Byte-level BPE trained on the corpus (so any text encodes), with ChatML's special tokens: <|im_end|> is EOS
    (it closes the assistant's turn), <|endoftext|> pads, and there is no BOS (as in Qwen2)."""

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CHATML_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus_strings(corpus), trainer)
    template = CHATML if chat_template == "chatml" else chat_template
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
        model_max_length=32768,
    )


def build_tokenizer(spec: dict | None):
    spec = dict(spec or {"kind": "char"})
    kind = spec.pop("kind", "char")
    if kind == "char":
        return char_tokenizer(spec.get("alphabet", DEMO_ALPHABET))
    if kind == "bpe":
        if "corpus" not in spec:
            raise RecipeError("tokenizer.kind=bpe needs tokenizer.corpus (files to train it on)")
        corpus = [spec["corpus"]] if isinstance(spec["corpus"], str) else spec["corpus"]
        return bpe_tokenizer(int(spec.get("vocab_size", 512)), corpus, spec.get("chat_template"))
    raise RecipeError(f"unknown tokenizer.kind {kind!r}: choose char or bpe")


def init_model(recipe_path: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Build the tokenizer and a randomly initialised causal LM from the recipe; return the output folder."""

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and not force:
        return out_dir
    try:
        recipe = yaml.safe_load(Path(recipe_path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"cannot read model recipe {recipe_path}: {str(exc).splitlines()[0]}") from None
    architecture = recipe.pop("architecture", "llama")
    seed = recipe.pop("init_seed", 0)
    tok = build_tokenizer(recipe.pop("tokenizer", None))
    try:
        config = AutoConfig.for_model(
            architecture,
            vocab_size=len(tok),
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            dtype="float32",
            **recipe,
        )
    except ValueError as exc:
        raise RecipeError(f"{recipe_path}: {str(exc).splitlines()[0]}") from None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return out_dir
