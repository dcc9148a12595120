"""Layer graph: what the planner knows about a model, read from the meta model."""
