"""`make bench`: side-by-side benchmarks (not collected by pytest: files are named bench_*.py)."""
