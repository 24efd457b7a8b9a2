"""The class server (labsrc.classroom.server): JupyterHub on loopback, two roster students logged in over HTTP,
launches through each student's own JupyterLab (its kernels' REST API and websocket) that run as that student
and lease slots of a pool (the hub's 2 cores, then 2 fake GPU slots), a third run that waits its turn, a killed
run's lease freed at once, one student in a real browser, and nothing left once the hub stops.

Needs root (system accounts, PAM, the spawner's setuid), jupyterhub and the proxy (`make test-class-server`
installs both); skips with its reason otherwise. One hub serves the whole module; its accounts go at the end.
"""
from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import psutil
import pytest

from labsrc.classroom import accounts, pool_setup, settings as class_settings
from labsrc.classroom.settings import PROXY_COMMAND
from labsrc.core import leases
from labsrc.core.paths import REPO
from waiting import wait_until

requests = pytest.importorskip("requests", reason="requests comes with jupyterhub (make test-class-server)")
pytest.importorskip("jupyterhub", reason="jupyterhub is not installed: make test-class-server installs the extra")
pytest.importorskip("jupyterhub_idle_culler", reason="jupyterhub-idle-culler is missing: make test-class-server")
websocket = pytest.importorskip("websocket", reason="websocket-client is missing (pip install websocket-client)")
if os.geteuid() != 0:
    pytest.skip("the class server needs root (accounts, PAM, setuid spawns): run as root", allow_module_level=True)
if not shutil.which("setfacl"):
    pytest.skip("setfacl is missing (apt-get install -y acl; make test-class-server does as root): the students must "
                "pass through the directories above the venv", allow_module_level=True)
if not os.access(PROXY_COMMAND, os.X_OK):
    pytest.skip(f"no configurable-http-proxy at {PROXY_COMMAND}: make test-class-server installs it",
                allow_module_level=True)

SHOW = """\
import json, os, pwd, sys, time
started = time.time()
time.sleep(float(sys.argv[2]))
seen = {"user": pwd.getpwuid(os.getuid()).pw_name, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cores": sorted(os.sched_getaffinity(0)), "started": started, "ended": time.time()}
with open(sys.argv[1], "w") as out:
    json.dump(seen, out)
"""
LAUNCH = ("import os\nfrom labsrc import launch\n{pool}"
          "launch.run({script!r}, nproc=1, timeout=150, args=[{out!r}, '{sleep}'])\nprint('launch ended')")


class Hub:
    def __init__(self, settings, students, passwords, base, startup_s, told=()):
        self.settings, self.students, self.passwords, self.base = settings, students, passwords, base
        self.url, self.startup_s, self.tokens, self.told = settings.url, startup_s, {}, list(told)

    def login(self, name: str) -> "requests.Session":
        """The login form, as a browser posts it (its _xsrf field), then the hub's cookies in a session."""
        session = requests.Session()
        form = session.get(f"{self.url}/hub/login")
        xsrf = re.search(r'name="_xsrf" value="([^"]+)"', form.text).group(1)
        answer = session.post(f"{self.url}/hub/login", data={"username": name, "password": self.passwords[name],
                                                              "_xsrf": xsrf}, allow_redirects=False)
        assert answer.status_code == 302, (answer.status_code, re.findall("Invalid username or password",
                                                                           answer.text))
        return session

    def token(self, name: str) -> dict:
        """A token the logged-in student makes for themselves (their own scopes), as an auth header."""
        if name not in self.tokens:
            session = self.login(name)
            made = session.post(f"{self.url}/hub/api/users/{name}/tokens", json={"note": "test"},
                                headers={"X-XSRFToken": session.cookies.get("_xsrf", path="/hub/")})
            assert made.status_code == 201, made.text
            self.tokens[name] = {"Authorization": f"token {made.json()['token']}"}
        return self.tokens[name]


@pytest.fixture(scope="module")
def hub():
    from labsrc.classroom import server as class_server
    from labsrc.launch import free_port
    base = Path(tempfile.mkdtemp(prefix="labsrc-hub-", dir="/tmp"))
    base.chmod(0o755)  # the students reach the pools and the script through it
    suffix = secrets.token_hex(2)
    students = [f"lt{suffix}ada", f"lt{suffix}bo"]
    (base / "roster.txt").write_text("".join(f"{name}\n" for name in students))
    (base / "show.py").write_text(SHOW)
    (base / "out").mkdir(mode=0o1777)
    (base / "out").chmod(0o1777)
    (base / "classroom.toml").write_text(
        f'roster = "{base}/roster.txt"\ngroup = "labsrc-test-{suffix}"\nport = {free_port()}\n'
        f'state_dir = "{base}/state"\npool_directory = "{base}/pool"\ncores = 2\ncores_per_run = 1\n'
        f'profile = "ci"\ngrant_group_traverse = true\nidle_timeout_s = 600\n'
        f'extra_server_args = ["--LabApp.expose_app_in_browser=True"]\n')
    pool_setup.init(base / "gpu-pool", gpus=2, gpus_per_run=1, fake_gpus=True)
    settings = class_settings.load(base / "classroom.toml")
    try:
        told = []
        startup_s = class_server.start(settings, echo=lambda line: (print(line), told.append(line)))
        passwords = dict(line.split() for line in (base / "state" / "passwords.txt").read_text().splitlines())
        yield Hub(settings, students, passwords, base, startup_s, told)
    finally:
        class_server.stop(settings)
        accounts.remove_students(accounts.read_roster(settings.roster), settings.group, base / "state")
        shutil.rmtree(base, ignore_errors=True)


class Kernel:
    """One kernel of a student's own server, driven as JupyterLab drives it: REST to start, a websocket to run."""

    def __init__(self, hub: Hub, name: str):
        self.prefix = f"{hub.url}/user/{name}/api/kernels"
        self.headers = hub.token(name)
        made = requests.post(self.prefix, headers=self.headers, json={"name": "labsrc"})
        assert made.status_code == 201, made.text
        self.id = made.json()["id"]
        self.socket = websocket.create_connection(
            f"{self.prefix.replace('http', 'ws', 1)}/{self.id}/channels", header=self.headers, timeout=180)

    def execute(self, code: str) -> str:
        message_id = secrets.token_hex(8)
        self.socket.send(json.dumps({"header": {"msg_id": message_id, "msg_type": "execute_request", "username": "",
                                                "session": secrets.token_hex(8), "version": "5.3"},
                                     "parent_header": {}, "metadata": {}, "channel": "shell",
                                     "content": {"code": code, "silent": False, "store_history": False,
                                                 "user_expressions": {}, "allow_stdin": False}}))
        return message_id

    def outputs(self, message_id: str) -> str:
        """Every iopub message the execution caused, as text, once it is idle again; fails on an error."""
        seen = []
        while True:
            message = json.loads(self.socket.recv())
            if message.get("parent_header", {}).get("msg_id") != message_id or message["channel"] != "iopub":
                continue
            seen.append(json.dumps(message["content"]))
            assert message["msg_type"] != "error", "\n".join(message["content"]["traceback"])
            if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
                return "\n".join(seen)


def start_servers(hub: Hub) -> None:
    """Each student starts their server (as the hub's Start button does) and it comes up."""
    for name in hub.students:
        asked = requests.post(f"{hub.url}/hub/api/users/{name}/server", headers=hub.token(name))
        assert asked.status_code in (201, 202), asked.text
    for name in hub.students:
        def ready():
            user = requests.get(f"{hub.url}/hub/api/users/{name}", headers=hub.token(name)).json()
            return user["servers"].get("", {}).get("ready")
        wait_until(ready, 120, f"{name}'s server up")


def held(pool: leases.Pool) -> list[dict]:
    return [slot for slot in leases.status(pool)["slots"] if slot["held"]]


def test_each_student_logs_in_and_gets_their_own_server_and_notebooks(hub):
    from labsrc.classroom import hub as class_hub
    print(f"hub start-up: {hub.startup_s:.1f} s")
    start_servers(hub)
    for name in hub.students:
        assert (class_hub.home_of(name) / "labsrc-course" / "docs").resolve() == REPO / "docs"
        server = [p for p in psutil.process_iter(["username", "cmdline"])
                  if p.info["username"] == name and "jupyterhub-singleuser" in " ".join(p.info["cmdline"] or [])]
        assert len(server) == 1, f"{name} should run one server of their own: {server}"
        copy = class_hub.home_of(name) / "labsrc-course" / "notebooks" / "00_setup.ipynb"
        assert copy.is_file() and copy.stat().st_uid == pwd.getpwnam(name).pw_uid
        script = copy.with_name("your_ddp_script.py")  # 01b's script: each student edits their own
        assert script.is_file() and not script.is_symlink() and script.stat().st_uid == pwd.getpwnam(name).pw_uid
    mine = class_hub.home_of(hub.students[0]) / "labsrc-course" / "notebooks" / "00_setup.ipynb"
    mine.write_text(mine.read_text() + "\n")  # the student's own edit
    written = mine.read_text()
    class_hub.copy_notebooks(hub.students[0], "labsrc-course")  # what the next spawn does
    assert mine.read_text() == written, "a later spawn must not overwrite a student's own notebook"
    with pytest.raises(AssertionError, match=r"^\(403, \['Invalid username or password'"):  # PAM said no
        Hub(hub.settings, hub.students, {hub.students[0]: "not-the-password"}, hub.base, 0).login(hub.students[0])


@pytest.mark.parametrize("kind", ["cores", "fake GPUs"])
def test_two_students_launch_at_once_on_their_own_slots_and_a_third_run_waits(hub, kind):
    """The hub's pool lends 2 cores (1 a run); the fake-GPU pool 2 GPU slots (1 a run), named in the kernel."""
    ada, bo = hub.students
    directory = hub.settings.pool_directory if kind == "cores" else hub.base / "gpu-pool"
    pool = leases.load(directory)
    choose = "" if kind == "cores" else f"os.environ['LABSRC_POOL_DIR'] = {str(directory)!r}\n"
    kernels = {"ada": Kernel(hub, ada), "bo": Kernel(hub, bo), "ada again": Kernel(hub, ada)}
    out = {who: hub.base / "out" / f"{kind.replace(' ', '_')}-{who.replace(' ', '_')}.json" for who in kernels}
    code = {who: LAUNCH.format(pool=choose, script=str(hub.base / "show.py"), out=str(out[who]),
                               sleep=0 if who == "ada again" else 6) for who in kernels}
    texts, failures, threads = {}, {}, []

    def run(who):
        try:
            texts[who] = kernels[who].outputs(kernels[who].execute(code[who]))
        except BaseException as exc:  # noqa: B036 (raised again in the test's thread below)
            failures[who] = exc
    for who in ("ada", "bo"):
        threads.append(threading.Thread(target=run, args=(who,)))
        threads[-1].start()
    wait_until(lambda: len(held(pool)) == 2, 90, "both students' runs holding a slot")
    holders = {slot["user"] for slot in held(pool)}
    assert holders == {ada, bo}, f"each slot's holder is the student whose kernel launched: {holders}"
    threads.append(threading.Thread(target=run, args=("ada again",)))
    threads[-1].start()
    for thread in threads:
        thread.join(timeout=200)
        assert not thread.is_alive(), "a launch through a student's kernel did not end within 200 s"
    for who, failure in failures.items():
        raise AssertionError(f"{who}'s launch failed") from failure
    seen = {who: json.loads(out[who].read_text()) for who in kernels}
    assert all("launch ended" in texts[who] for who in kernels), texts
    assert "runs ahead" in texts["ada again"], "the third run's cell should show its wait in the pool"
    assert [seen[who]["user"] for who in kernels] == [ada, bo, ada], seen
    assert all(out[who].stat().st_uid == pwd.getpwnam(seen[who]["user"]).pw_uid for who in kernels)
    slot = "gpus" if kind == "fake GPUs" else "cores"
    assert str(seen["ada"][slot]) != str(seen["bo"][slot]), f"two students' runs on one slot at once: {seen}"
    for earlier in ("ada", "bo"):  # the third run shares a slot with an earlier one only after it ended
        if str(seen[earlier][slot]) == str(seen["ada again"][slot]):
            assert seen["ada again"]["started"] >= seen[earlier]["ended"], seen
    assert held(pool) == [] and list((directory / leases.QUEUE_DIR).iterdir()) == []
    for kernel in kernels.values():
        kernel.socket.close()


def test_a_killed_run_frees_its_lease_within_a_second(hub):
    pool = leases.load(hub.settings.pool_directory)
    kernel = Kernel(hub, hub.students[1])
    kernel.execute(LAUNCH.format(pool="", script=str(hub.base / "show.py"), out=str(hub.base / "out" / "killed.json"),
                                 sleep=60))
    wait_until(lambda: len(held(pool)) == 1, 90, "the run holding its core")
    holder = psutil.Process(held(pool)[0]["pid"])
    assert holder.username() == hub.students[1]
    holder.kill()  # the student's kernel, killed (the launcher inside it and the torchrun agent it started)
    freed_s = wait_until(lambda: held(pool) == [], 5, "the killed run's core free again")
    print(f"a killed run's lease was free {freed_s:.2f} s after the kill")
    assert freed_s < 1.0
    kernel.socket.close()


def test_the_start_tells_whether_students_can_read_the_solutions(hub):
    """Told, checked as a student: readable as the checkout ships; withheld once the group's ACL entry denies it."""
    from labsrc.classroom import server as class_server
    solutions = REPO / "solutions"
    assert any(line.startswith(f"solutions/: students can read {solutions}") for line in hub.told), hub.told
    subprocess.run(["setfacl", "-m", f"g:{hub.settings.group}:---", str(solutions)], check=True)
    try:
        told = class_server.solutions_statement(hub.settings, hub.students[0])
    finally:
        subprocess.run(["setfacl", "-x", f"g:{hub.settings.group}", str(solutions)], check=True)
    assert told.startswith("solutions/: withheld"), told
    assert class_server.solutions_statement(hub.settings, hub.students[0]).startswith("solutions/: students can read")


def test_a_students_links_never_make_the_hub_write_as_root(hub):
    """The hub copies notebooks into a student's home at each spawn; a link the student put there (their course
    folder, or a notebook, pointing at a root-only place) must not make it write there: it writes as the student."""
    from labsrc.classroom import hub as class_hub
    name = hub.students[1]
    notebooks = class_hub.home_of(name) / "labsrc-course" / "notebooks"
    kept = notebooks.with_name("notebooks.kept")
    closed = hub.base / "root-only"
    closed.mkdir(mode=0o755)  # root's: the student may enter it, not write in it
    notebooks.rename(kept)
    try:
        notebooks.symlink_to(closed)
        os.lchown(notebooks, pwd.getpwnam(name).pw_uid, -1)
        with pytest.raises(RuntimeError, match="Permission denied"):
            class_hub.copy_notebooks(name, "labsrc-course")
        assert list(closed.iterdir()) == [], "the hub wrote as root where the student's link pointed"
        notebooks.unlink()
        kept.rename(notebooks)
        setup = notebooks / "00_setup.ipynb"
        setup.unlink()
        setup.symlink_to(closed / "made-by-root")  # a link to a file not there yet
        class_hub.copy_notebooks(name, "labsrc-course")
        assert not (closed / "made-by-root").exists() and setup.is_symlink()
    finally:
        if notebooks.is_symlink():
            notebooks.unlink()
        if kept.exists():
            kept.rename(notebooks)
        if (notebooks / "00_setup.ipynb").is_symlink():
            (notebooks / "00_setup.ipynb").unlink()
        class_hub.copy_notebooks(name, "labsrc-course")
    assert (notebooks / "00_setup.ipynb").stat().st_uid == pwd.getpwnam(name).pw_uid


def test_a_student_runs_notebook_00s_first_launch_in_a_real_browser(hub, tmp_path):
    """Headless Chromium (as tests/test_browser.py drives it): the hub's login form, the student's own copy of
    notebook 00 in their JupyterLab, its first launch cell run, its bars live and then done."""
    from test_browser import _browser, _playwright, _run_cell
    sync_api = _playwright()
    shots = Path(os.environ.get("LABSRC_SCREENSHOT_DIR") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    name = hub.students[0]
    import nbformat
    copy = nbformat.read(pwd.getpwnam(name).pw_dir + "/labsrc-course/notebooks/00_setup.ipynb", 4)
    code = [i for i, cell in enumerate(copy.cells) if cell.cell_type == "code"]
    launch_cell = next(i for i in code if "launch.run(" in copy.cells[i].source)
    with sync_api.sync_playwright() as playwright:
        browser = _browser(playwright, tmp_path / "chromium-profile")
        page = browser.new_page()
        page.set_default_timeout(90_000)
        page.goto(f"{hub.url}/hub/login")
        page.fill("#username_input", name)
        page.fill("#password_input", hub.passwords[name])
        page.screenshot(path=shots / "hub_1_login.png")
        page.click("#login_submit")
        page.wait_for_url(re.compile(f"/user/{name}/lab"))
        assert page.url.endswith("/lab/tree/notebooks/00_setup.ipynb"), page.url
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
                               " && window.jupyterapp.shell.currentWidget.sessionContext?.session?.kernel?.status"
                               " === 'idle'")
        try:
            cells = page.locator(".jp-Notebook .jp-Cell")
            _run_cell(page, code[0])  # the imports and the script's path
            _run_cell(page, launch_cell)
            cell = cells.nth(launch_cell)
            cell.locator(".labsrc-progress-state").first.wait_for(state="attached")  # the bars, live
            cell.scroll_into_view_if_needed()
            live = cell.locator(".labsrc-progress-state").first.inner_text()
            page.screenshot(path=shots / "hub_2_launch_live.png")
            cell.locator(".labsrc-progress-state", has_text="done").first.wait_for(state="attached")
            printed = cell.locator(".jp-OutputArea-output", has_text="ranks, wall time")
            printed.wait_for(state="attached")
            assert f"lines kept in /home/{name}/labsrc-course/runs/" in printed.inner_text(), printed.inner_text()
            rank1 = "[rank1] rank 1 of 2: before all_reduce [2], after [3]"  # hello_distributed.py's line
            assert cell.locator(".jp-OutputArea-output", has_text=rank1).count() == 1
            cell.screenshot(path=shots / "hub_3_launch_done.png")
            page.get_by_text("Nbgrader", exact=True).first.click()  # the student's side of nbgrader only
            menu = page.locator("#jp-mainmenu-nbgrader")
            menu.wait_for(state="visible")
            page.screenshot(path=shots / "hub_5_nbgrader_menu.png")
            shown = menu.locator(".lm-Menu-item:visible .lm-Menu-itemLabel")  # the disabled tools' items: hidden
            items = [text.strip() for text in shown.all_inner_texts()]
            assert items == ["Assignment List"], f"the students' Nbgrader menu: {items}"
            page.keyboard.press("Escape")
            print(f"the launch cell's state, first seen: {live!r}, then 'done'")
        finally:
            page.screenshot(path=shots / "hub_4_page.png")
        browser.close()
    print(f"screenshots: {shots}")


def test_stopping_the_hub_leaves_no_process_of_the_students_or_the_hub(hub):
    from labsrc.classroom import server as class_server
    state = hub.settings.state_dir
    hub_process = psutil.Process(int((state / "jupyterhub.pid").read_text()))
    ours = [hub_process, psutil.Process(int((state / "proxy.pid").read_text())), *hub_process.children(recursive=True)]
    ours += [p for p in psutil.process_iter(["username"]) if p.info["username"] in hub.students]
    assert {p.info["username"] for p in ours if hasattr(p, "info")} == set(hub.students), "both servers running"
    left = class_server.stop(hub.settings)
    assert left == [], f"the hub left processes of the students behind: {left}"
    alive = []
    for process in ours:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.NoSuchProcess:
            pass
    assert alive == [], f"still running after the hub stopped: {alive}"
