"""Before a run: the planner, the memory trace, estimate and advice, and a measured real step."""
