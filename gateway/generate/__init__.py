"""Generation and streaming: choices submitted to workers, their tokens assembled into text,
rendered as OpenAI bodies and delivered as one body or server-sent events."""
