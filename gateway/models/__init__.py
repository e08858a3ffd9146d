"""The models a gateway serves: their text (vocabulary, template, tools), where they run,
and loading them on demand through `serve`'s manager."""
