"""Flows: the demo sweep (more sweeps, reports and reconcile as flows come with later work)."""
