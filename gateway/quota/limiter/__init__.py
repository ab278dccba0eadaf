"""Token-aware rate limiting: GCRA leaky buckets over several scopes, in memory or in Redis."""
