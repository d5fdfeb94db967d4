"""The model family: zerotrain.modeling.model (ModelArgs, presets, Transformer), zerotrain.modeling.sizes (depth and
scaling rules), zerotrain.modeling.hf (the Hugging Face Llama format)."""
