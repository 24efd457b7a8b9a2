"""The class server's settings and roster are checked before anything starts (no root, no JupyterHub needed)."""
import pytest

from labsrc.classroom import accounts, settings as class_settings
from labsrc.classroom.server import memory_statement, tls_statement


def write(tmp_path, text: str):
    (tmp_path / "roster.txt").write_text("ada\n")
    path = tmp_path / "classroom.toml"
    path.write_text(f'roster = "{tmp_path}/roster.txt"\n' + text)
    return path


def test_the_shipped_settings_load_and_serve_loopback_without_claiming_tls():
    settings = class_settings.load()
    assert settings.loopback and not settings.tls and settings.url.startswith("http://127.0.0.1:")
    assert "TLS: off" in tls_statement(settings) and "loopback" in tls_statement(settings)
    assert "NOT enforced" in memory_statement(settings)  # the local spawner
    assert [s.name for s in accounts.read_roster(settings.roster)] == ["ada", "alan"]


def test_opening_the_hub_without_tls_is_refused_unless_a_tls_proxy_is_declared(tmp_path):
    with pytest.raises(class_settings.SettingsError, match="clear text"):
        class_settings.load(write(tmp_path, 'ip = "0.0.0.0"\n'))
    behind = class_settings.load(write(tmp_path, 'ip = "0.0.0.0"\nplain_http_behind_proxy = true\n'))
    assert "reverse proxy" in tls_statement(behind) and not behind.loopback
    (tmp_path / "cert.pem").write_text("x")
    (tmp_path / "key.pem").write_text("x")
    opened = class_settings.load(write(tmp_path, f'ip = "0.0.0.0"\ntls_cert = "{tmp_path}/cert.pem"\n'
                                                 f'tls_key = "{tmp_path}/key.pem"\n'))
    assert opened.url.startswith("https://") and "TLS: on" in tls_statement(opened)
    with pytest.raises(class_settings.SettingsError, match="go together"):
        class_settings.load(write(tmp_path, f'tls_cert = "{tmp_path}/cert.pem"\n'))


def test_unknown_settings_and_bad_values_say_what_to_change(tmp_path):
    with pytest.raises(class_settings.SettingsError, match=r"unknown setting\(s\) \['gpu'\]"):
        class_settings.load(write(tmp_path, "gpu = 2\n"))
    with pytest.raises(class_settings.SettingsError, match="'local' or 'systemd'"):
        class_settings.load(write(tmp_path, 'spawner = "docker"\n'))
    with pytest.raises(class_settings.SettingsError, match="not an address"):
        class_settings.load(write(tmp_path, 'ip = "localhost:80"\n'))
    for bad, said in (('port = "8000"\n', "port = '8000' should be a whole number"),
                      ("gpus = -2\n", "gpus = -2 should be a whole number >= 0"),
                      ("fake_gpus = 1\n", "fake_gpus = 1 should be true or false"),
                      ('instructors = "ada"\n', "instructors = 'ada' should be a list of strings"),
                      ("state_dir = 3\n", "state_dir = 3 should be a path")):
        with pytest.raises(class_settings.SettingsError, match=said):
            class_settings.load(write(tmp_path, bad))
    assert "enforced by systemd" in memory_statement(class_settings.load(write(tmp_path, 'spawner = "systemd"\n')))


def test_a_roster_names_each_student_once_with_a_valid_username(tmp_path):
    roster = tmp_path / "roster.txt"
    roster.write_text("# class of 2026\nada, Ada Lovelace\n\nalan  # late\n")
    assert accounts.read_roster(roster) == [accounts.Student("ada", "Ada Lovelace"),
                                                  accounts.Student("alan")]
    roster.write_text("ada\nAda Lovelace\n")
    with pytest.raises(accounts.AccountError, match=":2: 'Ada Lovelace' is not a valid username"):
        accounts.read_roster(roster)
    roster.write_text("ada\nada\n")
    with pytest.raises(accounts.AccountError, match="listed twice"):
        accounts.read_roster(roster)


def test_the_systemd_spawner_missing_is_named_before_anything_starts(tmp_path):
    """spawner = 'systemd' without jupyterhub-systemdspawner: the start says what to install, not the hub's log."""
    import importlib.util
    import os
    from labsrc.classroom import server
    if os.geteuid() != 0 or importlib.util.find_spec("jupyterhub") is None or importlib.util.find_spec(
            "jupyterhub_idle_culler") is None or importlib.util.find_spec("systemdspawner") is not None:
        pytest.skip("needs root, jupyterhub and its culler, and no systemdspawner installed")
    settings = class_settings.load(write(tmp_path, 'spawner = "systemd"\n'))
    with pytest.raises(server.ClassServerError, match="jupyterhub-systemdspawner"):
        server._check_prerequisites(settings)
