"""Vision-language models on the worker: which families it serves, and the refusal by name of
a model folder of any other."""
