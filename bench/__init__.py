"""topodra's benchmarks, importable as ``bench`` (installed by the dev setup, hack/pyproject.toml) so the
tests that run their reduced sizes import them by name."""
