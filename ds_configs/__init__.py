"""Hardware profiles (DeepSpeed JSON + a `zerotrain` section), shipped as package data of
`zerotrain.ds_configs` and found with importlib.resources (zerotrain.launcher.profiles)."""
