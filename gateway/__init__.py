"""Stateless OpenAI-compatible HTTP gateways that forward requests to workers over ZeroMQ.

A request's path, one module a step:

    app.py         the route checks the body (params.py, prompts.py) into a GenerationRequest
    request.py     GenerationRequest: id, body, prompts with their SamplingParams, n, stops
    group.py       GenerationGroup.start submits each choice, as one, then merges their output
    generation.py  Generation: one choice, a worker sequence submitted through pool.py
    pool.py        WorkerPool: one client per worker (endpoints.py resolves them); routing.py
                   picks the worker: most headroom, or the one that served the prompt's prefix
    client.py      WorkerClient: one worker's DEALER socket, routing replies to each RequestHandle
    assembly.py    TextAssembly: tokens to text, stop strings, finish reason, usage (pure)
    streaming.py   deliver as server-sent events or as one body, watching for disconnects
    render.py      the OpenAI response bodies and stream chunks

Tool calls (chat with `tools`): tools.py checks them and builds the grammar a required call
needs (tool_grammar.py), tool_template.py renders them through the chat template, and
render.py hands the text to tool_parser.py for `tool_calls`. /v1/embeddings takes a shorter
path: embeddings.py sends one Embed through client.py and shapes the vectors it gets back.

What goes wrong with the worker is raised as a worker_errors.py exception; errors.py alone
turns it into an HTTP status.
"""
