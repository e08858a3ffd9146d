"""The workers: the pool that routes to them, one DEALER connection per worker, CURVE keys, and the
transport errors a worker connection raises."""
