# See __init__.pyi: untyped.
from typing import Any

def __getattr__(name: str) -> Any: ...
