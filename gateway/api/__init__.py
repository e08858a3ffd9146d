"""The OpenAI API shapes: request and response bodies, and errors in OpenAI's shape."""
