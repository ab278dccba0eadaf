"""What the gateway and the reference backend agree on, importing neither: the OpenAI wire
format (request validation, the error shape and its middleware), tokenization with the model's
tokenizer, vLLM's chained KV block hashes, and loopback ports for the programs and their tests.

``backend`` (a separate program that knows no gateway) and ``gateway`` (which works in front
of any engine) both import this package; it imports neither of them."""
