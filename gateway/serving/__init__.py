"""The chat path as one service: a request body in, a response (one body or a stream) out.

builder.py turns a body into a GenerationRequest, deciding each prompt's parameters once;
chat.py (ChatServing) runs it on the workers of its model. The routes of http/ and the
translations of translate/ (Responses, Messages) call ChatServing, nothing below it.
"""
