"""`python -m labsrc.launch`: run a lab, a module or a script on n ranks (the launcher lives in labsrc.core.launch)."""
from labsrc.core.launch import LaunchError, LaunchTimeout, RankFailed, RunResult, main, run  # noqa: F401

if __name__ == "__main__":
    import sys
    sys.exit(main())
