"""A tiny GGUF file written by the tests themselves with the `gguf` package (as llama.cpp's converter writes one): a
Llama with random weights, some tensors quantized to Q8_0 and Q4_1, a byte-level BPE tokenizer trained here, ChatML
special tokens and a chat template. No download: `rlpipe import-gguf` is tested on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tasks.data.model_recipe import CHATML

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128, 2, 2, 1, 256  # head_dim 64, which vLLM's CPU attention supports
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 7 + 5? The answer is 12.",
    "Add 3 and 4. 3 + 4 = 7.",
    "Multiply 6 by 7: 42.",
    "hello world, tiny model",
] * 20


def _tokenizer_parts() -> tuple[list[str], list[str]]:
    """Tokens (byte-level spelling, by id) and merges of a small BPE trained on CORPUS, specials first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS, trainer)
    model = json.loads(core.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def write_tiny_gguf(path: Path, architecture: str = "llama", seed: int = 0, add_bos: bool | None = None) -> Path:
    """`add_bos`: the file's tokenizer.ggml.add_bos_token (None: not written, as llama.cpp's Llama files often omit)."""
    import gguf

    tokens, merges = _tokenizer_parts()
    vocab = len(tokens)
    rnd = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("rlpipe tiny test llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHATML)

    def tensor(name: str, shape: tuple[int, ...], scale: float = 0.08, qtype=None):
        data = (rnd.standard_normal(shape) * scale).astype(np.float32)
        if qtype is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)  # its shape: bytes per row

    q8, q4 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
    tensor("token_embd.weight", (vocab, HIDDEN), 0.5, q8)  # tied: no output.weight
    for i in range(LAYERS):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{i}.attn_q.weight", (HIDDEN, HIDDEN), qtype=q4)
        tensor(f"blk.{i}.attn_k.weight", (KV_HEADS * HIDDEN // HEADS, HIDDEN), qtype=q4)
        tensor(f"blk.{i}.attn_v.weight", (KV_HEADS * HIDDEN // HEADS, HIDDEN))
        tensor(f"blk.{i}.attn_output.weight", (HIDDEN, HIDDEN), qtype=q8)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        tensor(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), qtype=q4)
        tensor(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN))
        tensor(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), qtype=q8)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
