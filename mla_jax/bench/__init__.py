"""Benchmarks that ship with the package: `common` (ceilings measured in the same run, timing, profiler
summaries, the results JSON) and `e2e` (the end-to-end engine step, `mla-jax bench`). The kernel and multi-GPU
benchmarks live in the repository's `bench/` and import `common` from here."""
