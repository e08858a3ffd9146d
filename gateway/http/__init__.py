"""The HTTP edge: the FastAPI app and its routes, middleware, the server and its draining."""
