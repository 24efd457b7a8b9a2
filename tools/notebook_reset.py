"""`make reset-notebooks`: the course's notebooks back as committed, each changed one first kept in saved_work/.

Nothing is lost and nothing is asked: every course file under notebooks/ and appendix/ that differs from the
commit checked out (an edited notebook, a filled-in your_ddp_script.py) is copied to
``saved_work/<date>-<time>/<its path>`` and then restored with ``git checkout``. Files you added yourself (a
notebook of your own) are neither copied nor touched. saved_work/ is ignored by git.
"""
import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

COURSE_FOLDERS = ("notebooks", "appendix")


def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {root}: {done.stderr.strip()}\n"
                           "reset-notebooks needs a git clone of the course; with a downloaded copy, download it again")
    return done.stdout


def changed_course_files(root: Path) -> list[str]:
    """Tracked files under the course folders that differ from HEAD (edited or deleted), as repository paths."""
    listing = git(root, "diff", "--name-only", "HEAD", "--", *COURSE_FOLDERS)
    return sorted(line for line in listing.splitlines() if line)


def reset(root: Path, stamp: str | None = None) -> tuple[list[str], Path | None]:
    """Copy each changed course file to saved_work/<stamp>/, then restore it from HEAD; return (paths, folder)."""
    changed = changed_course_files(root)
    if not changed:
        return [], None
    folder = root / "saved_work" / (stamp or time.strftime("%Y%m%d-%H%M%S"))
    for path in changed:
        source = root / path
        if source.exists():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / path)
    git(root, "checkout", "HEAD", "--", *changed)
    return changed, folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/notebook_reset.py", description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the course's clone (default: here)")
    options = parser.parse_args(argv)
    try:
        changed, folder = reset(options.root.resolve())
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 2
    if not changed:
        print("Every course notebook is already as committed: nothing to reset.")
        return 0
    print(f"Restored {len(changed)} file(s) as committed; your versions are kept in {folder}:")
    for path in changed:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
