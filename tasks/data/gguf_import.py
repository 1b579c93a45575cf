"""Import a GGUF file (llama.cpp's format) as an ordinary Hugging Face model folder (`rlpipe import-gguf`).

transformers reads GGUF files itself (`from_pretrained(folder, gguf_file=...)`): it parses the metadata into a config
and a tokenizer (chat template included) and dequantizes every tensor to float. The model it returns stays flagged as
quantized, though (its config carries a `quantization_config` and `save_pretrained` refuses it), so vLLM and the
trainer could not use it. This module rebuilds the same architecture from a clean copy of that config, moves the
dequantized weights into it, and saves safetensors, the tokenizer (with its chat template, adding BOS and EOS as the
file records) and the generation config. The result loads with `AutoModelForCausalLM.from_pretrained(out_dir)`, in
vLLM and in the trainer, like any folder.

Every failure a user can cause (no such file, not a GGUF file, a truncated one, an architecture transformers cannot
read from GGUF) is one line naming the file and what is wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from gguf import GGUFReader
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from schemas.errors import UserError
from storage.stage_io import sha256_file

GGUF_MAGIC = b"GGUF"
DTYPES = ("float32", "bfloat16")
# Keys of transformers' GGUF mapping that are metadata sections, not architectures.
_NOT_ARCHITECTURES = {"general", "tokenizer"}


class GGUFImportError(UserError, ValueError):
    pass


def supported_architectures() -> list[str]:
    """The GGUF `general.architecture` values this transformers can turn into a model."""

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in _NOT_ARCHITECTURES)


def read_architecture(path: Path) -> tuple[str, GGUFReader]:
    """The file's `general.architecture`, after checking that it is a complete GGUF file, and its reader."""
    if not path.is_file():
        raise GGUFImportError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise GGUFImportError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")

    try:
        reader = GGUFReader(str(path))  # maps every tensor: a truncated file fails here
        field = reader.get_field("general.architecture")
        architecture = field.contents() if field is not None else None
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise GGUFImportError(f"{path} is truncated or corrupt: {str(exc).splitlines()[0][:160]}") from None
    if not architecture:
        raise GGUFImportError(f"{path} has no general.architecture field")
    return str(architecture), reader


def import_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "float32", force: bool = False) -> Path:
    """Convert `gguf_file` into a Hugging Face folder at `out_dir` (written whole, then renamed into place)."""

    src, out = Path(gguf_file), Path(out_dir)
    if dtype not in DTYPES:
        raise GGUFImportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if (out / "config.json").exists() and not force:
        raise GGUFImportError(f"{out} already holds a model; pass --force to replace it")
    architecture, reader = read_architecture(src)
    supported = supported_architectures()
    if architecture not in supported:
        raise GGUFImportError(
            f"{src}: transformers cannot load architecture {architecture!r} from GGUF (it can: {', '.join(supported)})"
        )
    torch_dtype = getattr(torch, dtype)
    where = {"pretrained_model_name_or_path": str(src.resolve().parent), "gguf_file": src.name}
    tokenizer = AutoTokenizer.from_pretrained(**where)
    _add_special_tokens_as_recorded(tokenizer, reader)
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch_dtype)
    model = _without_quantization_flag(loaded, torch_dtype)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    _record_source(tmp, src, architecture, dtype)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _add_special_tokens_as_recorded(tokenizer, reader: GGUFReader) -> None:
    """Whether the tokenizer adds BOS and EOS, as the file's tokenizer.ggml.add_bos_token and add_eos_token say:
    transformers' GGUF tokenizer leaves them out, and a model trained with BOS degenerates without it (Gemma 3 270M:
    "The capital of France is" went on " France. The The The ...", and with BOS " the capital of the country ...")."""
    for token in ("bos", "eos"):
        field = reader.get_field(f"tokenizer.ggml.add_{token}_token")
        if field is not None and bool(field.contents()) != getattr(tokenizer, f"add_{token}_token", False):
            setattr(tokenizer, f"add_{token}_token", bool(field.contents()))  # rebuilds the post-processor


def _without_quantization_flag(loaded, torch_dtype):
    """The same architecture and weights in a model that is not flagged as quantized."""

    config = loaded.config.__class__.from_dict(
        {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    )
    config.dtype = torch_dtype
    # Built on the CPU, not on the meta device: non-persistent buffers (rotary frequencies) must be real. The weights
    # are held twice for a moment; strict=True proves every tensor found its place.
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    return model.eval()


def _record_source(folder: Path, src: Path, architecture: str, dtype: str) -> None:
    """Where the weights came from, for whoever finds the folder later (and for `fetch-model`'s cache check)."""

    info = {
        "gguf_file": src.name,
        "gguf_sha256": sha256_file(src),
        "architecture": architecture,
        "dtype": dtype,
        "imported_by": "rlpipe import-gguf",
    }
    (folder / "rlpipe_import.json").write_text(json.dumps(info, indent=2) + "\n")
