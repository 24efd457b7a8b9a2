"""Lesson 12, debugging clinic: planted bugs bounded by timeouts, and the tools that find them."""
