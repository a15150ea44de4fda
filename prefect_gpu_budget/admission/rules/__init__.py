"""The rules that decide, pure: no I/O, no clock, no threads (tests/test_layers.py holds them to
it). The ledger, the gate, the simulator, the audit and the benchmarks all decide through them.

- `deciding`: a job's admission, with the reason for every no (`decide`, `plan`);
- `policy`: the terms it decides in: budgets, holds, the ledger's state, a decision;
- `quota`: pools and team quotas, what a job's shape takes;
- `capacity`: what an org's pools hold while the queue is walked, and why a job does not fit
  (`Capacity`);
- `queueing`: who waits behind whom, and what a waiting job blocks;
- `preemption`: whether a job fits a pool now, and whom it preempts (`fit`, `victims`);
- `requests`: a job asking to be admitted, as the policy reads it (`Request`);
- `accounting`: what a job costs and where its money lands, a bill's true-up included;
- `periods`: calendar periods in a time zone;
- `timing`: the liveness clocks;
- `orphans`: what to do with a job whose holder is gone.
"""
