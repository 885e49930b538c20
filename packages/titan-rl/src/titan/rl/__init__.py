"""titan.rl."""
