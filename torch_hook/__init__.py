"""Per-rank probe for Artemis (placeholder until the probe lands; see issue 3)."""
