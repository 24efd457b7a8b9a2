"""Lesson 00, setup: the first 2-rank launch and its all-reduce."""
