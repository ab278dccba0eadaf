"""The virtual-time fleet simulator (``tokengate simulate``) and the capacity planner.

The gateway's own routing code and the reference backend's own scheduler, KV cache and timing
model, run together in one process on a discrete-event clock (see ``simulator.run``).
"""
