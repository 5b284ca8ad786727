"""What `tmq COMMAND --help` says a command exits with is what it exits with. The exit codes
themselves are tested against real brokers elsewhere (tests/test_tier_readers.py,
tests/test_outage_cli.py); an operator scripting on the help must not take a cold tier that did
not answer (exit 4, decisions 810 and 923) for a broker that did not (exit 1)."""

from __future__ import annotations

from broker_harness import tmq


def _help(*command: str) -> str:
    """The command's help as one line of words (rich's boxes and wrapping taken out)."""
    shown = tmq(*command, "--help", env={"COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    return " ".join(shown.stdout.replace("│", " ").split())


def test_replay_help_says_a_cold_tier_that_does_not_answer_exits_4() -> None:
    """tests/test_tier_readers.py: past `--cold-wait` of refusals, exit 4. The option's help
    still said exit 1 after decision 923 changed the code."""
    text = _help("replay")
    assert "then exit 4 naming it" in text, text
    assert "exit 1" not in text, text


def test_status_help_names_exit_4_beside_0_and_1() -> None:
    """`tmq status` exits 4 when every broker answered but a tiered queue's lag is unknown
    (cli/status.py, decision 810); its help named only 0 and 1."""
    text = _help("status")
    assert "exit code 0 when every broker answers, 1 when one does not, 4 when the cold tier" in (
        text
    ), text
