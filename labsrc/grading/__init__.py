"""Exercises collected and graded with nbgrader: exercise sheets generated from the lessons, the instructor's flow, the summary."""
