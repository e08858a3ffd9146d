"""The model-owning worker: a continuous-batching tick loop over llama.cpp."""
