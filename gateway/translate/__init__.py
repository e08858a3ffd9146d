"""Other APIs at the edge: OpenAI's Responses and Anthropic's Messages, each translated into a
chat request, run through the chat path, and its answer translated back (bridge.py)."""
