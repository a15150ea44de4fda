"""The benchmarks, and the harness they share with the tests (`benchmarks.harness`).

Each benchmark runs as `python -m benchmarks.<name>` from the repository root (or as
`python benchmarks/<name>.py`; the soak and the chaos campaign are packages, so
`python benchmarks/soak` and `python benchmarks/chaos`)."""
