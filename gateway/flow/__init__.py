"""Flow control: requests wait in the gateway when a pool is saturated, in per-flow queues
ordered by priority band, fair share (VTC) and deadline."""
