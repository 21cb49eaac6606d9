"""POST /v1/messages (Anthropic's Messages API), translated to a chat generation: the request
and its content blocks become chat messages, tools and a response format (request.py,
content.py, tools.py, conversation.py, translate.py); the chat answer and its chunks become the
message object and its SSE events (objects.py, answer.py, events.py, run.py); errors leave in
Anthropic's shape (errors.py)."""
