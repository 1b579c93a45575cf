"""vLLM-CPU's LoRA products, one matmul per adapter instead of one copy of the adapter's matrices per token.

vLLM-CPU computes each LoRA layer's products with `vllm.lora.ops.torch_ops` (`bgmv_shrink`, `bgmv_expand`,
`bgmv_expand_slice`; the `sgmv_*` prefill versions call them): it gathers `weights[indices]`, a (tokens, out, in) copy
of the adapter matrices, then multiplies token by token. On SmolLM2-135M with a rank-16 adapter on every linear layer
that made generation 4× slower than without an adapter (79 s against 20 s for 128 samples of ≤ 32 tokens, measured on
2 cores): the copies cost far more than the products. Here the tokens are grouped by adapter index and each group
multiplied by its adapter's matrices once: the same products (up to float summation order), computed in the same
process before the engine starts. Indices that do not match the input rows (vLLM-CPU's LoRA prompt-logprobs path, which
fails there) go to vLLM's own function unchanged.
Imports: vLLM's LoRA ops inside `install`, which the vLLM worker calls once vLLM is loaded with its settings.
"""

from __future__ import annotations

import torch


def grouped_products(inputs, weights, indices, dtype):
    """out[t] = weights[indices[t]] @ inputs[t] for every row t: (T, out), one matmul per distinct index."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights  # (adapters, out, in)
    x = inputs.to(dtype)
    distinct = torch.unique(indices)
    if distinct.numel() == 1:
        return x @ w[int(distinct[0])].to(dtype).T
    out = torch.empty(x.shape[0], w.shape[1], dtype=dtype)
    for k in distinct.tolist():
        rows = (indices == k).nonzero().squeeze(1)
        out[rows] = x[rows] @ w[k].to(dtype).T
    return out


def _matches(inputs, indices) -> bool:
    return indices.dim() == 1 and indices.numel() == inputs.shape[0]


def make_ops(original):
    """Replacements for vLLM's bgmv_shrink, bgmv_expand and bgmv_expand_slice, with their signatures and their output
    handling; `original` holds vLLM's own functions (the fallback)."""

    def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        if not _matches(inputs, lora_indices_tensor):
            return original["bgmv_shrink"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling)
        outputs = grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        if not _matches(inputs, lora_indices_tensor):
            return original["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        outputs = grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        common = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
        if add_inputs:
            output_tensor[:, :common] += outputs[:limit, :common]
        else:
            output_tensor[:, :common] = outputs[:limit, :common]

    def bgmv_expand_slice(
        inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True
    ):
        if not _matches(inputs, lora_indices_tensor):
            return original["bgmv_expand_slice"](
                inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs
            )
        outputs = grouped_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
        else:
            output_tensor[:, slice_offset : slice_offset + slice_size] = outputs

    return {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def install() -> None:
    """Put the grouped products where vLLM-CPU's LoRA wrapper and its prefill functions look them up."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops, "_rlpipe_grouped", False):
        return
    original = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}
    for name, fn in make_ops(original).items():
        setattr(lora_ops, name, fn)  # sgmv_* call these by their module-level names
        setattr(punica_cpu, name, fn)  # the CPU wrapper imported them by name
    lora_ops._rlpipe_grouped = True
