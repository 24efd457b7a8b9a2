# JupyterHub's configuration for the course's class server: everything comes from classroom.toml (or the file
# LABSRC_CLASS_SETTINGS names) through labsrc.core.class_hub. Start it with `make class-server`.
import os

from labsrc.core import class_hub, class_settings

c = get_config()  # noqa: F821 (JupyterHub provides it)
class_hub.configure(c, class_settings.load(os.environ.get("LABSRC_CLASS_SETTINGS")))
