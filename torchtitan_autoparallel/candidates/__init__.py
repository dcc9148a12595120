"""What may be chosen: candidate meshes, per-block strategies, pipeline schedules and
what a family's adapter cannot apply."""
