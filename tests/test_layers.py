"""The package layering and the packaging that follows from it.

Layers, top to bottom: ``cli`` -> ``broker`` | ``namesrv`` -> ``offload`` | ``lakehouse`` ->
``tiered`` (the contracts live in pyproject.toml, ``[tool.importlinter]``). A core install
(``pip install tmq``, no extra) runs the broker, the NameServer and the CLI without Spark, delta-rs
or pandas.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

from broker_harness import REPO

BIN = Path(sys.executable).parent


def lint_imports(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "lint-imports"), "--no-logo", "--no-cache", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_import_points_down_the_layers() -> None:
    result = lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_layer_contract(tmp_path: Path) -> None:
    # The contract can fail: the same configuration, with tiered importing the broker.
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    probe = REPO / "tiered" / "_layer_probe.py"
    probe.write_text("import broker.metadata  # noqa: F401\n")
    try:
        lines = [
            "[importlinter]",
            "root_packages =\n    " + "\n    ".join(config["root_packages"]),
            "[importlinter:contract:layers]",
            "name = layers",
            "type = layers",
            "layers =\n    " + "\n    ".join(config["contracts"][0]["layers"]),
        ]
        ini = tmp_path / "layers.ini"
        ini.write_text("\n".join(lines) + "\n")
        result = lint_imports("--config", str(ini))
    finally:
        probe.unlink()
    assert result.returncode != 0
    assert "tiered._layer_probe -> broker.metadata" in result.stdout


def test_the_core_install_needs_neither_spark_nor_delta_nor_pandas() -> None:
    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip() for d in core}
    assert not names & {"pyspark", "deltalake", "delta-spark", "pandas"}, names
    # And nothing the core runs imports them: load every server and CLI module with those
    # packages made unimportable, and let the CLI build its command tree.
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class Missing(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("pyspark", "deltalake", "delta", "pandas"):
                    raise ModuleNotFoundError(f"No module named {name!r} (core install)")
                return None

        sys.meta_path.insert(0, Missing())
        import broker.server, namesrv.server, offload.offloader, offload.verify, cli.app
        from broker.config import load_config
        load_config(None, env={})
        sys.argv = ["tmq", "broker", "start", "--help"]
        try:
            cli.app.main()
        except SystemExit as e:
            assert e.code in (0, None), e.code
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout
