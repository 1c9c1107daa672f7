"""The planner: what training a recipe takes before it launches, from the model's config and the data alone: the
devices a plan is for, the model's shape, the memory plan, the FLOP count and the time and cost plan."""
