"""Stage `dataset` (iteration 0): the user's prompt files, read, checked, formatted and tokenized once.

Reads `data.train_files` and `data.eval_files` (or a held-out fraction of the train rows), or the sources of
`data.sources` (tasks/data/data_sources.py), with the tokenizer of model.path; writes `dataset` (split, prompt_id,
text, prompt_token_ids, messages, answer, extra). The fingerprint covers the files' contents, the data and prompt
sections and the tokenizer, so changing any of them re-reads.
Every later stage (prompts, eval, generated preferences) samples from this table, never from the files.
"""

from __future__ import annotations

from schemas.errors import NotFound
from storage import StageOutput, read_manifest
from storage.model_ids import tokenizer_fingerprint
from tasks.data.datasets import files_fingerprint
from tasks.data.formatting import load_tokenizer
from tasks.data.prompt_dataset import build_prompt_dataset
from tasks.stages.common import Computed, load_run, run_stage, stage_task
from tasks.stages.spec import StageSpec

SPEC = StageSpec("dataset", reads=(), sections=("data", "prompt", "model"), scope="run")


def dataset_fingerprint(ctx) -> tuple[str, dict]:
    """The complete `dataset` stage's fingerprint and statistics (prompts per split), for the stages that read it."""
    manifest = read_manifest(ctx.layout, "dataset", 0)
    if manifest is None:
        raise NotFound(f"run {ctx.layout.run_id!r} has no complete dataset stage")
    return manifest["fingerprint"], manifest["extra"]


@stage_task("dataset")
def dataset_task(storage_root: str, run_id: str) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)
    d = ctx.cfg.data

    def compute():
        table, stats = build_prompt_dataset(d, ctx.cfg.prompt, load_tokenizer(ctx.cfg.model.path), ctx.cfg.seed)
        return Computed(table, extra=stats)

    inputs = {
        "train_files": files_fingerprint(d.train_files, "data.train_files") if d.train_files else "",
        "eval_files": files_fingerprint(d.eval_files, "data.eval_files") if d.eval_files else "",
        "tokenizer": tokenizer_fingerprint(ctx.cfg.model.path),
        # A mix's files (its generators' settings are in the data section); set only for a mix, so that the
        # fingerprints of runs without one stay as they were.
        **(
            {
                f"source_{s.name}_{side}": files_fingerprint(files, f"data.sources[{s.name}].{side}")
                for s in d.sources
                for side, files in (("train_files", s.train_files), ("eval_files", s.eval_files))
                if files
            }
        ),
    }
    return run_stage(ctx, 0, inputs=inputs, compute=compute)
