"""Benchmark and experiment scripts, kept out of the `batchserve` package: nothing in the
product imports them. Each is run from the repository root as a module,

    python -m benchmarks.foundation --out BENCHMARKS.md

and writes (or replaces) its own section of a Markdown file through `benchmarks.report_md`.
They import `batchserve`; `batchserve` never imports them.
"""
