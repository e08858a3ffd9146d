"""Stateless OpenAI-compatible HTTP gateways that forward requests to the worker over ZeroMQ."""
