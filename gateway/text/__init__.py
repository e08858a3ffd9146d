"""Text: the tokenizer and detokenizer, chat templates, JSON-schema grammars and stop strings."""
