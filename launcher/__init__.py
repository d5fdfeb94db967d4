"""zerotrain driver: configuration, profiles, the training loop, checkpoints, the `zerotrain` command."""
