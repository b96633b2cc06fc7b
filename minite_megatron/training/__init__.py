"""Training-script helpers: data, progress bar, model providers for the examples."""
