"""Lesson 04, DDP internals: DDP by hand (per parameter, then bucketed from hooks) and torch's DDP looked into."""
