"""The class server: JupyterHub for a class, its settings, the students' accounts, the GPU pool."""
