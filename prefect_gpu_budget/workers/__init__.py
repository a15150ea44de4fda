"""Prefect worker types whose flow runs pass the budget gate before they start."""
