"""The finetune panel (`finetune ui`), installed as finetune.ui: a Gradio app in ui/app.py over the workspace in
ui/workspace.py.

Importing this package builds nothing and imports neither gradio nor torch.
"""
