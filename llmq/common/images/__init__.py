"""Image input on the API's side, torch-free: the bytes of an image part (a data URL, base64,
or a link fetched under an SSRF guard) decoded and checked with Pillow before anything is
queued, then stored once in Redis by content hash for the worker."""
