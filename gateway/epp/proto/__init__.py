"""Envoy's ext_proc v3 messages (``ext_proc.proto``); ``ext_proc_pb2`` is generated from it
when the package is built."""
