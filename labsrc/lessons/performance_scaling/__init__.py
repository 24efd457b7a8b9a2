"""Lesson 06, performance and scaling: the benchmark (lab_bench), the step split, scaling arithmetic."""
