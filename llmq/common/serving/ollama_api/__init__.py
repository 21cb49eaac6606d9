"""Ollama's API (/api/chat, /api/generate, /api/embed, /api/tags, /api/show, ...), translated
onto the generation service: the bodies and Ollama's runner options (request.py, options.py)
become chat, completion and embedding requests (translate.py); the chat and completion answers
and their chunks become Ollama's objects and NDJSON lines (objects.py, chunks.py, run.py); the
served models become Ollama's model list, show and ps answers (models.py, model_facts.py)."""
