"""The recipe: its schema and sections, its train: and stage sections, rewards, type checks, YAML reading; and the
planner (devices, memory plan, FLOP count, time plan)."""
