# pyright's view of llama_cpp (pyproject.toml's [tool.pyright] stubPath): every name untyped.
# The package's own annotations describe its ctypes bindings loosely (a
# pointer where an array is passed, `bytes` where a char buffer is), which would flag every
# call made the way ctypes wants it.
from typing import Any

def __getattr__(name: str) -> Any: ...
