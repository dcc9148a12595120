"""Cost model: hardware profiles, collectives, per-block time and memory."""
