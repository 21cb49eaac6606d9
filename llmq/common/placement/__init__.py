"""Which worker takes a request: ``policy`` scores the workers (cached prefix, load, loaded
adapters) and chooses, ``placer`` is the API's side that asks it for each request, and
``block_hashes`` holds the prompt-block hashes the placer and the worker's prefix cache share."""
