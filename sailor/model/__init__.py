"""Models: ModelSpec (a decoder-only transformer as a layer list), the built-in registry, activation
memory per layer, and Hugging Face configs."""
