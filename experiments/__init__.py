"""absl entry points: train, evaluate, study."""
