# JupyterHub's configuration for the course's class server: everything comes from classroom.toml (or the file
# LABSRC_CLASS_SETTINGS names) through labsrc.classroom.hub. Start it with `make class-server`.
import os

from labsrc.classroom import hub, settings

c = get_config()  # noqa: F821 (JupyterHub provides it)
hub.configure(c, settings.load(os.environ.get("LABSRC_CLASS_SETTINGS")))
