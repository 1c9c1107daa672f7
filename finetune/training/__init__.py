"""A run: the one pre-launch check, the trainer arguments, TRL's trainers bound to the run folder, callbacks, resume,
the launcher, Ray, MLflow tracking."""
