"""The model: llama.cpp's model and contexts (engine.py, embeddings.py), the batch
(batch.py), images through libmtmd (media.py), the passes' threads (threads.py), and the
native matmul kernels swapped into drawing passes behind the fence that keeps them to a
verified llama.cpp (kernels.py, native_fence.py)."""
