"""How the model is placed and replicated: one module per strategy."""
