"""Counting prompts as the engine will (``tokenize``) and who may count off the event loop
(``slots``): below the request path, routing and the limiter alike, which all use the counts."""
