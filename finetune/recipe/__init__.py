"""The recipe: its schema and sections, its train: and stage sections, rewards, type checks and YAML reading."""
