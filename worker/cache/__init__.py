"""Prefix reuse, plain Python: which slot's cached cells (or which entry saved in host memory)
a request starts from."""
