"""The Plan value (JSON, table, checks), its assembly from a solution, re-costing a plan
file, and a recipe expressed as a plan."""
