"""The README's first command, run as a newcomer runs it: from a fresh clone, in a virtualenv the
README's install line made. It must show the whole flow and keep serving.

(The second command runs this suite; running it from here would recurse.)"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from broker_harness import REPO, free_port


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None, "the README opens with a bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_the_readme_opens_with_exactly_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2
    assert "tmq standalone" in commands[0] and "pytest" in commands[1]


def split_install(command: str) -> tuple[str, str]:
    """A README command as (its virtualenv and install, what it runs with them)."""
    install, run = command.rsplit(" && ", 1)
    return install, run


def test_ci_installs_with_the_readmes_own_line() -> None:
    """``.ci/run`` installs with the README's line, verbatim, and both README commands share it:
    what lets the quickstart test below run in CI's fresh clone without installing again."""
    (install, _), (again, tests) = map(split_install, readme_commands())
    assert install == again
    assert f"{install} && {tests}" in (REPO / ".ci" / "run").read_text()


def ci_fresh_clone() -> bool:
    """This suite runs from ``.ci/run`` in a fresh clone, in the virtualenv that the README's own
    install line made there (the test above holds .ci/run to that line): the clone's tracked
    files are its commit's, and no quickstart has run in it yet."""
    if os.environ.get("CI") != "true" or Path(sys.prefix).resolve() != REPO / ".venv":
        return False
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return changed.returncode == 0 and changed.stdout == "" and not (REPO / "tmq-data").exists()


def test_the_quickstart_runs_from_a_fresh_clone(tmp_path: Path) -> None:
    """The README's first command from a fresh clone. In CI the suite's own checkout is that
    clone, and its virtualenv was just made by the same install line: the test runs the rest of
    the command there, instead of a second clone installing everything again beside the running
    suite (decision 570). Elsewhere it clones into a temporary directory and runs the whole
    command, install included."""
    in_place = ci_fresh_clone()
    if in_place:
        clone, command = REPO, split_install(readme_commands()[0])[1]
    else:
        clone, command = tmp_path / "tmq", readme_commands()[0]
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=120)
    try:
        run_quickstart(clone, command, tmp_path / "quickstart.log")
    finally:
        if in_place:
            shutil.rmtree(REPO / "tmq-data", ignore_errors=True)


def run_quickstart(clone: Path, command: str, log: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    # The README's command, exactly; only its ports come from the environment, so a busy
    # machine (another broker on 8081/9876/5557) cannot break the test.
    env |= {
        "TMQ_STANDALONE_GRPC_PORT": str(free_port()),
        "TMQ_STANDALONE_NAMESRV_PORT": str(free_port()),
        "TMQ_STANDALONE_METRICS_PORT": str(free_port()),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            cwd=clone,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop bash, pip, tmq alike
        )
    try:
        deadline = time.monotonic() + 900  # a fresh virtualenv, then Spark's first start
        while "quickstart done" not in log.read_text(errors="replace"):
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        time.sleep(2)
        assert proc.poll() is None, "tmq standalone keeps serving after the quickstart"
        output = log.read_text()
        for step in ("[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"):
            assert step in output
        assert "all 1000 of this run byte-identical" in output
        assert "Traceback" not in output
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    deadline = time.monotonic() + 30  # bash goes at once; tmq drains and closes the store
    while "stopped cleanly" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "stopped cleanly" in log.read_text()
    assert (clone / "tmq-data" / "lake" / "quickstart-orders" / "_delta_log").is_dir()
