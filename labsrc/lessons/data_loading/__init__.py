"""Lesson 03, data loading: DistributedSampler's shards, uneven inputs, the loader as the bottleneck."""
