"""What the user asked: the job's settings read once, checked, and turned into planning
inputs (constraints, features, pins, the model config and their fingerprint)."""
