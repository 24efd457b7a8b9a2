"""Lesson 13, capstone: an image classifier end to end with DDP, AMP and compile, and its scaling report."""
