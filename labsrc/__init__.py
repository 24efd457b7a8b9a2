"""Shared code for the distributed-training course: rank context, launching, data, models, training, records."""
