"""POST /v1/responses (OpenAI's Responses API), translated to a chat generation: the request
becomes chat messages, tools and a response format (request.py, items.py), the chat answer and
its chunks become the response object and its typed events (objects.py, answer.py,
events.py)."""
