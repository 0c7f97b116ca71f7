"""Benchmarks (``mori bench <what>``). Each prints mori beside a baseline measured in the same
run and writes a JSON record (date, GPU, driver, config) under ``benches/results/``."""
