"""What a resident trainer keeps between requests, and the rule for when it may reuse it.

Every checkpoint a trainer writes carries `trainer_state.json` with a fresh random id, and the trainer keeps
the engine that wrote it tagged with that id. A later request that resumes from a checkpoint reuses the engine
only if the checkpoint's id is the engine's, the request resumes its optimizer state from that same
checkpoint, and the engine settings are the same: then the engine's weights and optimizer moments are exactly
what a fresh load would give. An engine built ahead from a model folder (a warm start) is reused only by a request
for that folder, unchanged since (its id and its weight files' time), with a fresh optimizer and the same settings.
Any other request (another checkpoint, a rewind, a resumed run after a crash, a failed update) loads from disk.
An engine is taken out of the cache while it trains, so a failure halfway leaves nothing stale behind.
Imports: the LoRA module (peft) only for adapter checkpoints.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from dataclasses import dataclass

STATE_FILE = "trainer_state.json"


def read_state(checkpoint: str) -> dict:
    """The checkpoint's `trainer_state.json`: its id and the number of trainer ranks that saved its optimizer state."""
    try:
        with open(os.path.join(checkpoint, STATE_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def read_state_id(checkpoint: str) -> str | None:
    return read_state(checkpoint).get("id")


def write_state_id(
    checkpoint: str,
    world_size: int = 1,
    state_id: str | None = None,
    pending: bool = False,
    weights_only: bool = False,
) -> str:
    """Mark the checkpoint's optimizer state complete under a new id (or `state_id`), or with `pending` as still being
    written by the resident trainer (tasks/engines/workers/deferred_state.py), or with `weights_only` as having none
    (checkpoint.every: only the trainer that wrote it holds its state). Written by a rename: never half a file."""
    state_id = state_id or uuid.uuid4().hex
    flags = {"pending": pending, "weights_only": weights_only}
    state = {"id": state_id, "world_size": world_size, **{k: True for k, on in flags.items() if on}}
    tmp = os.path.join(checkpoint, f".{STATE_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, os.path.join(checkpoint, STATE_FILE))
    return state_id


def weights_only(checkpoint: str) -> bool:
    """True for a checkpoint written without optimizer state (checkpoint.every)."""
    return bool(read_state(checkpoint).get("weights_only"))


def state_pending(checkpoint: str) -> bool:
    """True while the checkpoint's weights are in place and its optimizer state is not yet: the resident trainer writes
    it after answering the update, and a command that stopped before it was done left it so for good."""
    return bool(read_state(checkpoint).get("pending"))


@dataclass
class _Slot:
    state_id: str | None  # the id of the checkpoint the engine wrote
    settings: str
    engine: object
    optimizer: object
    loaded_from: tuple | None = None  # or (folder, its identity) it was built from, with a fresh optimizer

    def holds(self, checkpoint: str, resume_state: str | None) -> bool:
        if self.loaded_from is not None:
            return resume_state is None and self.loaded_from == (checkpoint, _identity(checkpoint))
        state = read_state(checkpoint)
        return (
            resume_state == os.path.join(checkpoint, "ds_state")
            and self.state_id == state.get("id")
            and not state.get("pending")
        )


class EngineCache:
    """Trainer engines by role ("policy", "critic"), plus frozen inference models (the reference) by path."""

    MAX_FROZEN = 2  # the reference and the starting policy, which are usually the same folder anyway

    def __init__(self) -> None:
        self._slots: dict[str, _Slot] = {}
        self._frozen: dict[tuple[str, str | None, float], object] = {}
        self.hits = {"engine": 0, "frozen": 0}
        # A DeferredState (tasks/engines/workers/deferred_state.py) where the trainer writes optimizer states after
        # answering: a resident trainer with one rank.
        self.deferred = None

    def take_engine(self, role: str, checkpoint: str, resume_state: str | None, settings):
        """(engine, optimizer) whose state is exactly `checkpoint` + `resume_state`, or None."""
        slot = self._slots.pop(role, None)  # while it trains it matches no checkpoint
        if slot is None or slot.settings != _key(settings) or not slot.holds(checkpoint, resume_state):
            return None
        self.hits["engine"] += 1
        return slot.engine, slot.optimizer

    def keep_engine(self, role: str, state_id: str, engine, optimizer, settings) -> None:
        self._slots[role] = _Slot(state_id, _key(settings), engine, optimizer)

    def keep_loaded_engine(self, role: str, folder: str, engine, optimizer, settings) -> None:
        """An engine built from the model in `folder` with a fresh optimizer, before any request asked for it."""
        self._slots[role] = _Slot(None, _key(settings), engine, optimizer, loaded_from=(folder, _identity(folder)))

    def held_engine(self, role: str, checkpoint: str):
        """The kept engine whose state `checkpoint` holds, or None. Not an engine built ahead: the model it starts from
        is read as a frozen model, as without one."""
        slot = self._slots.get(role)
        if slot is None or slot.loaded_from is not None or slot.state_id != read_state_id(checkpoint):
            return None
        return slot.engine

    def partitioned(self) -> bool:
        """Whether a kept engine partitions its weights over the ranks (ZeRO-3): reading them is then a collective."""
        return any(slot.engine.zero_optimization_stage() == 3 for slot in self._slots.values())

    def engine_module(self, role: str, checkpoint: str):
        """The module of the kept engine whose state `checkpoint` holds (for a forward pass), or None."""
        engine = self.held_engine(role, checkpoint)
        if engine is None:
            return None
        self.hits["engine"] += 1
        return engine.module

    def adapter_host(self, base_path: str):
        """A kept engine's peft model whose base model is `base_path` (the base weights never train: with its adapter
        switched off it is that model, so the reference needs no second copy), or None."""
        from tasks.engines.workers.lora import base_path_of

        for slot in self._slots.values():
            if base_path_of(slot.engine.module) == os.path.abspath(base_path):
                self.hits["frozen"] += 1
                return slot.engine.module
        return None

    def frozen(self, path: str, load):
        """A model that is never trained here, loaded once: keyed by its folder, state id and weight files' mtime."""
        key = (path, *_identity(path))
        if key in self._frozen:
            self.hits["frozen"] += 1
            return self._frozen[key]
        while len(self._frozen) >= self.MAX_FROZEN:
            self._frozen.pop(next(iter(self._frozen)))
        self._frozen[key] = model = load()
        return model


def _identity(folder: str) -> tuple:
    return read_state_id(folder), _weights_mtime(folder)


def _key(settings) -> str:
    return json.dumps(dataclasses.asdict(settings), sort_keys=True)


def _weights_mtime(path: str) -> float:
    try:
        return max(os.path.getmtime(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    except (OSError, ValueError):
        return 0.0
