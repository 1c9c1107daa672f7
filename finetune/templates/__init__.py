"""The templates the toolkit ships: the builtin models' chat template and the model card's."""
