"""The model family: modeling.model (ModelArgs, presets, Transformer), modeling.sizes (depth and
scaling rules), modeling.hf (the Hugging Face Llama format)."""
