"""``tokengate serve``'s HTTP front: the hardened server protocol (``http_guard``), the routes
and admin endpoints (``routes``), the process (socket, workers, signals, drain: ``process``),
the OpenAPI document and policy reloads."""
