"""Tool calling: the tools of a chat request checked, rendered through the template, forced by a
grammar and parsed back out of the text."""
