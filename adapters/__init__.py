"""Framework adapters (AutoGen, CrewAI, LangChain). Each is an optional extra, imported lazily."""
