"""Benchmarks: each module prints a table and the ratios an issue asks for, run from the
repository root as ``python -m bench.<name>`` (``bench/README.md`` lists them and their results).
They share ``bench.timing`` (clocks, threads, interleaved medians, tables) and
``bench.peak_memory``, time the training loop's own step, and check against the oracles the tests
use (``tests.oracles``)."""
