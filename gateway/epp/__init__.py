"""tokengate as the Gateway API Inference Extension's Endpoint Picker: ext_proc behind Envoy
(``gateway.epp.server``), one exchange per request (``gateway.epp.exchange``)."""
