"""Several hosts, one truth (promise 15): Prefect's multi-replica server with hosts made of
namespaces on this machine (`cluster.py`)."""
