"""The routing brain: endpoint state, prefix index, scheduling plugins, prefill→decode."""
