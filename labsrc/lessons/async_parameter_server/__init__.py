"""Lesson 11, asynchronous updates: a parameter server, staleness, local SGD."""
