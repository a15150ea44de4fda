"""Placement: a job that asks for accelerators (`H100:8`) rather than a machine is placed on the
offering with the lowest expected cost that fits its budgets, can start within its max wait and
ends before its deadline.

- `accelerators`: the request, in SkyPilot's spelling, and which catalog machines match it;
- `offerings`: every way the admin's launchers and pools can run it, with each cloud's limits;
- `choice`: the decision, pure (no clock, no I/O): expected cost and start from each offering's
  history, the worst case reserved, and why every other offering was passed over.
"""
