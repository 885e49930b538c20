"""titan.recipes: named configurations and the `titan` command."""
