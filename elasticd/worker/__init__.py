"""The worker library: what a training script imports to cooperate with the daemon."""
