"""The model: llama.cpp's context and batch, the samplers and their grammars, drawing a token
from a row, logprobs, and embeddings."""
