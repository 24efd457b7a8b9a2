"""Lesson 02, collectives: the lab, plots and exercises (the collectives themselves: labsrc.techniques)."""
