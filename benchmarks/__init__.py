"""Benchmarks run as ``python -m benchmarks.<name>``: each prints a table, writes JSON lines stamped with
commit, device and config, and has a ``--smoke`` mode that CI runs."""
