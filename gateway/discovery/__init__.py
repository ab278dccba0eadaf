"""Endpoints found at run time: an InferencePool's pods through the Kubernetes API
(``kube``), a headless Service's addresses through DNS (``dns``), applied to the gateway's
pools as they change (``found``)."""
