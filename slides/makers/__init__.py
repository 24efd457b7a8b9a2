"""Figure makers for the slide decks: slides/makers/<lesson>.py draws the figures of slides/NN_<lesson>.md.

The convention (slides/figures.py follows it for every deck, 00 onward): a module named like the lesson
defines `make(save)`; it runs the lesson's lab in the `ci` profile (labsrc.launch.run or forked ranks),
draws with labsrc/lessons/<lesson>/plots.py, and hands each figure to `save(name, figure, measured=...)`, which
writes slides/figures/NN_<name>.png. Diagrams of mechanisms are drawn in code with slides/makers/diagrams.py.
"""
