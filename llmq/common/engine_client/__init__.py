"""The API's and the batch tasks' client of the engines, beneath the generation service: a
model's prompts tokenized and bounded (``prompt_encoder``, ``prompt_bounds``,
``tokenize_pool``, ``text_input``), each request enqueued and its output streamed back as text
(``pipeline``, ``request_stream``, ``request_output``, ``tokenizer``), one pipeline per served
model (``model_registry``)."""
