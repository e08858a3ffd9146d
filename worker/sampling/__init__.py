"""Sampling: each request's sampler (samplers.py), the draw of a token from a row of logits
on the host (draw.py, rowscan.py: csrc/sampling's C library) or inside llama_decode
(graph_draw.py; llama.cpp's own chains there, backend_sampling.py), grammars on llguidance
(guidance.py, grammar_compiler.py) and logprobs (logprobs.py)."""
