"""Request building: an OpenAI body checked into prompts, sampling parameters, a request."""
