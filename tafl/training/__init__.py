"""Training: data sources, long tail and partitions, models, FL methods, the simulator, evaluation."""
