"""Training loops and schedules."""

from neutreno.training.loop import predict, train_classifier, warmup_cosine

__all__ = ["predict", "train_classifier", "warmup_cosine"]
