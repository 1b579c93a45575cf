"""`make bench`: side-by-side benchmarks (not collected by pytest: files are named bench_*.py)."""


def result_row(benchmark: str, baseline: str, baseline_value: float, rlpipe_value: float, unit: str) -> dict:
    """One row of runs/bench/results.parquet; the ratio is rlpipe's advantage (greater is better)."""
    return {
        "benchmark": benchmark,
        "baseline": baseline,
        "baseline_value": baseline_value,
        "rlpipe_value": rlpipe_value,
        "unit": unit,
        "ratio": rlpipe_value / baseline_value,
    }
