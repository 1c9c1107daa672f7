"""A trained model: loading it back, chat, evaluation, export and its model card, and the OpenAI-compatible server."""
