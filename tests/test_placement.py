"""Whether a placement group can ever be placed (ray_cluster.why_unplaceable), by hand, for each strategy."""

from tasks.engines.ray_cluster import why_unplaceable

TWO_NODES = [{"CPU": 16.0, "GPU": 8.0}, {"CPU": 16.0, "GPU": 4.0}]


def test_a_resource_no_node_has():
    assert why_unplaceable({"GPU": 1}, 1, "PACK", [{"CPU": 2.0}]) == "no node has GPU 1 (the nodes have GPU 0)"
    assert why_unplaceable({"GPU": 16}, 1, "PACK", TWO_NODES) == "no node has GPU 16 (the nodes have GPU 8/4)"


def test_pack_and_spread_count_every_nodes_room():
    # 8 + 4 GPUs hold 12 one-GPU bundles but not 13; 2-GPU bundles: 4 + 2 = 6.
    assert why_unplaceable({"GPU": 1}, 12, "PACK", TWO_NODES) is None
    assert why_unplaceable({"GPU": 1}, 12, "SPREAD", TWO_NODES) is None
    assert why_unplaceable({"GPU": 1, "CPU": 2}, 13, "PACK", TWO_NODES) == (
        "13 bundles of {CPU 2, GPU 1} need more than the nodes have: at most 12 fit (CPU 16/16, GPU 8/4)"
    )
    assert why_unplaceable({"GPU": 2}, 7, "PACK", TWO_NODES).startswith("7 bundles of {GPU 2} need more")
    # CPU binds before GPU: 16 // 6 = 2 per node.
    assert why_unplaceable({"GPU": 1, "CPU": 6}, 5, "PACK", TWO_NODES).endswith("at most 4 fit (CPU 16/16, GPU 8/4)")


def test_strict_strategies():
    assert why_unplaceable({"GPU": 1}, 8, "STRICT_PACK", TWO_NODES) is None
    assert why_unplaceable({"GPU": 1}, 9, "STRICT_PACK", TWO_NODES) == (
        "no node holds all 9 bundles of {GPU 1} together (at most 8 on one)"
    )
    assert why_unplaceable({"GPU": 1}, 2, "STRICT_SPREAD", TWO_NODES) is None
    assert why_unplaceable({"GPU": 1}, 3, "STRICT_SPREAD", TWO_NODES) == (
        "3 bundles of {GPU 1} need 3 nodes that each hold one; 2 do"
    )


def test_an_empty_bundle_always_fits():
    assert why_unplaceable({}, 100, "STRICT_SPREAD", [{"CPU": 1.0}]) is None
    assert why_unplaceable({"GPU": 0}, 4, "PACK", [{"CPU": 1.0}]) is None


SCRIPT = """
import sys, time
import ray
from tasks.engines import ray_cluster
from tasks.engines.launch import WorkerError
from tasks.engines.resident import ResidentProcess

ray_cluster.connect(None)
cpus = int(ray.cluster_resources()["CPU"])
hog = ray.util.placement_group([{"CPU": cpus}])  # another engine's group holds every CPU
ray.get(hog.ready())
placement = ray_cluster.Placement(bundle=(("CPU", float(cpus)),), placement_timeout_s=2.0)
engine = ResidentProcess("tasks.engines.workers.trainer_server", sys.argv[1], placement=placement)
started = time.time()
try:
    engine.spawn(None)
except WorkerError as exc:
    print("LINE", str(exc))
    print("SECONDS", time.time() - started)
ray_cluster.stop()
"""


def test_a_group_held_back_by_others_fails_after_the_placement_timeout(tmp_path):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "engine.log")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("LINE", "SECONDS")))
    assert "LINE" in out, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert out["LINE"].startswith(
        "trainer_server was not placed within 2s (engines.placement_timeout_s): 1 bundles of {CPU "
    )
    assert "free now (other engines' groups hold the rest): no node has CPU" in out["LINE"]  # what is free, named
    assert 2 <= float(out["SECONDS"]) < 30
