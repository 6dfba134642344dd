"""The serving layer: OpenAI-shaped requests and replies (``openai_api``,
``completions``), tool calls and JSON mode in text, and the HTTP server."""
