"""tokengate: a token-aware L7 inference gateway."""
