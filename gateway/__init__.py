"""Stateless OpenAI-compatible HTTP gateways that forward requests to workers over ZeroMQ.

Subpackages by job, each importing only those below it (pyproject's import contracts):

    http/      the edge: app.py assembles the app and its routes; middleware (API keys,
               body limits, access log), server.py, /v1/embeddings, operators' views
    translate/ /v1/responses and /v1/messages, translated into the chat path and back
    serving/   the chat path as one service: ChatServing (chat.py) runs a completions or
               chat body on its model's workers; builder.py decides every parameter once;
               draining on SIGTERM
    models/    the models served: each one's vocabulary, template and tools (catalogue.py),
               which a request's `model` names and loading it on demand (registry.py)
               through `serve`'s manager (manager.py)
    generate/  group.py submits each choice (generation.py) and merges their output;
               assembly.py turns tokens into text; render.py shapes OpenAI's bodies and
               chunks; streaming.py delivers them as one body or server-sent events
    request/   params.py and prompts.py check a body into a GenerationRequest
               (generation_request.py): prompts with their SamplingParams, n, stops
    tools/     tool calls: checks.py, the call formats (format.py), rendering through the
               chat template (template.py), the grammar of a required call, the parser
               (parser.py, which reads each call's JSON with call_object.py)
    text/      tokenizer, chat templates, JSON-schema grammars, stop strings, reasoning
               markers (reasoning.py splits a reply's thinking from its answer)
    api/       OpenAI's request bodies (schemas.py, of fields.py's strict JSON types),
               response bodies (response_bodies.py) and error shape (errors.py)
    workers/   WorkerPool (pool.py) picks a worker (routing.py) among its members
               (membership.py); WorkerClient (client.py) is one worker's connection, routing
               replies to each request (open_requests.py, handle.py) over its DEALER socket
               (dealer.py); CURVE keys; the transport errors (errors.py)
    config.py, metrics.py, endpoints.py: settings, Prometheus metrics, worker addresses

What goes wrong with the worker is raised as a workers/errors.py exception; api/errors.py
alone turns it into an HTTP status.
"""
