"""Serverless token-level scaling: token velocity, an autoscaler with launchers (scale to
zero with held requests), convertible decoders, live request migration."""
