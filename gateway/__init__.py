"""Stateless OpenAI-compatible HTTP gateways that forward requests to workers over ZeroMQ.

A request's path, one module a step:

    app.py         the route checks the body (params.py, prompts.py) into a GenerationRequest
    request.py     GenerationRequest: id, body, prompt tokens, SamplingParams, stop strings
    generation.py  Generation.start submits it through pool.py, then reads the worker's output
    pool.py        WorkerPool: one client per worker (endpoints.py resolves them); routing.py
                   picks the worker: most headroom, or the one that served the prompt's prefix
    client.py      WorkerClient: one worker's DEALER socket, routing replies to each RequestHandle
    assembly.py    TextAssembly: tokens to text, stop strings, finish reason, usage (pure)
    streaming.py   deliver as server-sent events or as one body, watching for disconnects
    render.py      the OpenAI response bodies and stream chunks

What goes wrong with the worker is raised as a worker_errors.py exception; errors.py alone
turns it into an HTTP status.
"""
