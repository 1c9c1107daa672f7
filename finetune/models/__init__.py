"""Loading the tokenizer and the model a recipe names (transformers + PEFT, or Unsloth), and the architectures tests
build."""
