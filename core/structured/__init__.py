"""Structured output: tools and JSON in the prompt, grammars that constrain the reply, calls out of it."""
