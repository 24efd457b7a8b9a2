"""One folder per lesson, named like its notebook without the number: mechanisms, lab.py, plots.py, exercises.py."""
