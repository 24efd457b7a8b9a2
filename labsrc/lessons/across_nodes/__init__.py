"""Lesson 06b, across nodes: emulated nodes joined by a shaped link, the hierarchical all-reduce."""
