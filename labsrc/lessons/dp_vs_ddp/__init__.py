"""Lesson 01, DataParallel vs DDP (the sync experiment), and 01b, your own DDP script (script_*)."""
