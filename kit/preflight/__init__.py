"""Before a run: the planner and the memory estimate."""
