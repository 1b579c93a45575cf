"""The stage contract: atomic parts, manifest last, fingerprint skip, corruption detection, scan."""

import json

import polars as pl
import pytest

from schemas.tables import TableError
from storage import LayoutError, RunLayout, find_complete, read_stage, scan, write_stage


def prompts_frame(iteration, round_=0, n=3):
    from schemas.tables import PROMPTS

    return pl.DataFrame(
        {
            "iteration": [iteration] * n,
            "round": [round_] * n,
            "prompt_id": [f"p{round_}-{i}" for i in range(n)],
            "text": ["1+1="] * n,
            "prompt_token_ids": [[1, 5, 14, 5, 15]] * n,
            "messages": [[{"role": "user", "content": "1+1="}]] * n,
            "answer": ["2"] * n,
        },
        schema=PROMPTS.polars,
    )


def write(layout, it, fp="fp1", part=0, df=None):
    return write_stage(
        layout,
        "prompts",
        it,
        df if df is not None else prompts_frame(it, part),
        fp=fp,
        inputs={"x": "y"},
        config_hash="c",
        started=0.0,
        part=part,
        engines={"vllm": "0.32.0"},
    )


def test_manifest_records_parts_and_skip_by_fingerprint(tmp_path):
    layout = RunLayout(tmp_path, "r1")
    out = write(layout, 1)
    manifest = json.loads(layout.manifest_path("prompts", 1).read_text())
    assert manifest["rows"] == 3 and manifest["parts"][0]["sha256"] and manifest["engines"]["vllm"] == "0.32.0"
    assert manifest["schema"] == {"name": "prompts", "version": 2}
    assert {"started_at", "ended_at", "wall_seconds", "inputs", "config_hash"} <= manifest.keys()
    assert find_complete(layout, "prompts", 1, out.fingerprint) is not None
    assert find_complete(layout, "prompts", 1, "other") is None  # a changed input recomputes


def test_corrupt_part_is_detected_and_recomputed(tmp_path):
    layout = RunLayout(tmp_path, "r1")
    out = write(layout, 1)
    part = layout.part_path("prompts", 1, 0)
    part.write_bytes(part.read_bytes()[:-10])  # truncated
    with pytest.warns(UserWarning, match="sha256"):
        assert find_complete(layout, "prompts", 1, out.fingerprint) is None


def test_a_round_scoped_stages_wall_seconds_are_its_rounds_together(tmp_path):
    """The manifest is rewritten by each round: its wall_seconds is the sum of the parts' own, not the last round's."""
    import time

    layout = RunLayout(tmp_path, "r1")
    for part in range(3):
        write_stage(
            layout, "prompts", 1, prompts_frame(1, part), fp=f"f{part}", inputs={}, config_hash="c",
            started=time.time() - 10.0 * (part + 1), part=part,
        )  # fmt: skip
    manifest = json.loads(layout.manifest_path("prompts", 1).read_text())
    walls = [p["wall_seconds"] for p in manifest["parts"]]
    assert [round(w) for w in walls] == [10, 20, 30]
    assert manifest["wall_seconds"] == pytest.approx(sum(walls), abs=1e-3)
    write_stage(
        layout, "prompts", 1, prompts_frame(1, 1), fp="g", inputs={}, config_hash="c", started=time.time() - 5, part=1
    )
    assert round(json.loads(layout.manifest_path("prompts", 1).read_text())["wall_seconds"]) == 15  # round 2 dropped


def test_rounds_are_parts_and_rewriting_a_round_drops_later_ones(tmp_path):
    layout = RunLayout(tmp_path, "r1")
    write(layout, 1, "a", 0)
    write(layout, 1, "b", 1)
    assert read_stage(layout, "prompts", 1).height == 6
    write(layout, 1, "a2", 0)
    assert read_stage(layout, "prompts", 1).height == 3
    assert not layout.part_path("prompts", 1, 1).exists()


def test_scan_spans_complete_iterations_only(tmp_path):
    layout = RunLayout(tmp_path, "r1")
    write(layout, 1)
    write(layout, 2)
    layout.stage_dir("prompts", 3).mkdir(parents=True)
    prompts_frame(3).write_parquet(layout.part_path("prompts", 3, 0))  # no manifest: half-written
    df = scan("r1", "prompts", tmp_path).collect()
    assert sorted(df["iteration"].unique().to_list()) == [1, 2]


def test_schema_violations_are_one_line_errors(tmp_path):
    layout = RunLayout(tmp_path, "r1")
    with pytest.raises(TableError, match="missing column"):
        write(layout, 1, df=prompts_frame(1).drop("answer"))
    with pytest.raises(TableError, match="dtype"):
        write(layout, 1, df=prompts_frame(1).with_columns(pl.col("round").cast(pl.Int64)))
    with pytest.raises(TableError, match="duplicate"):
        write(layout, 1, df=pl.concat([prompts_frame(1), prompts_frame(1)]))
    assert not layout.manifest_path("prompts", 1).exists()  # nothing half-written is marked complete


@pytest.mark.parametrize("bad", ["../x", "a/b", "..", "", ".hidden"])
def test_run_ids_cannot_escape_the_root(tmp_path, bad):
    with pytest.raises(LayoutError):
        RunLayout(tmp_path, bad)


def test_checkpoints_are_not_listed_as_stages(tmp_path):
    layout = RunLayout(tmp_path, "r1")
    write(layout, 1)
    layout.checkpoint_dir(1).mkdir(parents=True)
    assert layout.stages() == ["prompts"]
