"""The commands: `finetune` and its options (cli), the planner's (estimate), the commands on trained models (chat,
serve, eval, export, ui), and the environment report and DDP health check (doctor)."""
