"""The sweep: a grid of trials under one budget, from its spec to its results.

- `spec`: the sweep's spec (`SweepSpec`, `load_spec`, `preflight`);
- `forecast` (with `simulator`): what a sweep will cost and when it will end, before it runs;
- `flow`: the Prefect flow that runs it (`gpu_sweep`), `recording` its results into the
  ledger's sweep store (`Ledger.sweeps`), `metrics_file` the trials' metrics it tails;
- `plots`: its charts, and the spend report's;
- `trial`: the runner a trial's job starts (`python -m prefect_gpu_budget.sweeps.trial`);
- `foreground`: a sweep (or the demo's server) run in the foreground by the CLI.

This package imports nothing at import: a trial runs `sweeps.trial` with the standard library
only, and the spec and the forecast load without Prefect.
"""
