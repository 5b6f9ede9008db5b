"""`gpuguard reap` and the MCP server's gpu_reap on Windows (issue 30's review): the
signals that stop a reap, the one PID-namespace check both paths share, and start-time
wording that holds on either platform.

A Windows `signal` module and a Windows process are what cannot exist here: the first is
played by a namespace with Windows' signal names, the second by Windows' real back-end
(gpuguard.host.windows.platform) set as the platform of the module that reads it.
Everything else is the real code.
"""

from __future__ import annotations

import argparse
import signal
import types

import pytest

from gpuguard.console import contract, reap
from gpuguard.console.cli import main as console_main
from gpuguard.console.contract import EXIT_USAGE, START_TIME_WORDS, Failure
from gpuguard.console.mcp import reap as mcp_reap
from gpuguard.console.mcp import tools as mcp_tools
from gpuguard.host.platform import linux
from gpuguard.host.windows import platform as windows_platform

#: Windows' signal module: no SIGHUP, a SIGBREAK (Ctrl-Break), numbered as there.
WINDOWS_SIGNAL = types.SimpleNamespace(SIGINT=2, SIGTERM=15, SIGBREAK=21, SIGABRT=22)


def test_ctrl_break_stops_a_reap_on_windows() -> None:
    assert reap.stop_signals(WINDOWS_SIGNAL) == (2, 15, 21)


def test_linux_keeps_its_three_stop_signals() -> None:
    assert reap.STOP_SIGNALS == (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    assert reap.stop_signals(signal) == reap.STOP_SIGNALS


def test_every_stop_signal_interrupts_an_armed_reap() -> None:
    """The handler StopOnSignal installs raises Interrupted for each of STOP_SIGNALS (the
    reaper turns that into resuming what it suspended)."""
    for sig in reap.STOP_SIGNALS:
        with reap.StopOnSignal() as stop:
            assert signal.getsignal(sig) == stop._handle
            stop.arm()
            with pytest.raises(reap.Interrupted, match=signal.Signals(sig).name):
                signal.raise_signal(sig)
        assert stop.signum == sig


# -- the PID namespace: one check for both paths ---------------------------------------------

def apply_args(*, allow: bool = False) -> argparse.Namespace:
    return argparse.Namespace(apply=True, start_time=1_733_000_000_123,
                              allow_pid_namespace=allow)


def settings(*, allow: bool = False) -> mcp_tools.ServeSettings:
    return mcp_tools.ServeSettings(config_path=None, hostname="win-a", allow_pid_namespace=allow)


@pytest.mark.parametrize(("windows", "in_host", "allow", "refused"), [
    (True, None, False, False),  # Windows: no PID namespaces (the probe says "cannot tell")
    (False, None, False, True),  # Linux, cannot tell: refused
    (False, False, False, True),  # Linux, a child namespace: refused
    (False, False, True, False),  # ... unless a person said NVML reports its pids
    (False, True, False, False),  # Linux, the host's namespace
])
def test_reap_and_gpu_reap_agree_on_the_pid_namespace(
        monkeypatch: pytest.MonkeyPatch, windows: bool, in_host: bool | None, allow: bool,
        refused: bool) -> None:
    monkeypatch.setattr(reap, "PLATFORM", windows_platform.BACKEND if windows else linux.BACKEND)
    monkeypatch.setattr(linux, "in_host_pid_namespace", lambda: in_host)
    assert reap.outside_host_pid_namespace(allow) is refused
    if refused:
        with pytest.raises(Failure, match="outside the host PID namespace") as cli:
            reap.check_arguments(apply_args(allow=allow))
        assert cli.value.code == EXIT_USAGE
        with pytest.raises(mcp_tools.ToolRefusal, match="outside the host PID namespace"):
            mcp_reap.check_reap_call(settings(allow=allow), True, 1_733_000_000_123)
    else:
        reap.check_arguments(apply_args(allow=allow))
        mcp_reap.check_reap_call(settings(allow=allow), True, 1_733_000_000_123)


def test_the_mcp_path_has_no_condition_of_its_own() -> None:
    """One check, not two copies of it: gpu_reap calls reap's function."""
    assert mcp_reap.outside_host_pid_namespace is reap.outside_host_pid_namespace
    assert "in_host_pid_namespace" not in vars(mcp_reap)


# -- start times, on either platform --------------------------------------------------------

def test_start_time_wording_names_both_encodings() -> None:
    assert "clock ticks since boot on Linux" in START_TIME_WORDS
    assert "milliseconds since the epoch on Windows" in START_TIME_WORDS
    schema = mcp_tools.ARGUMENTS[mcp_tools.REAP]["root_start_time"].schema
    assert START_TIME_WORDS in schema["description"]
    with pytest.raises(mcp_tools.ToolRefusal) as bad:
        mcp_tools.start_time_value("root_start_time", -1)
    assert START_TIME_WORDS in bad.value.message
    with pytest.raises(Failure) as missing:
        reap.check_arguments(argparse.Namespace(apply=True, start_time=None,
                                                allow_pid_namespace=True))
    assert START_TIME_WORDS in missing.value.message and "TICKS" not in missing.value.message
    assert "Ctrl-Break on Windows" in contract.REAP_EPILOG


def test_reap_help_shows_a_platform_neutral_start_time(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    with pytest.raises(SystemExit):
        console_main(["reap", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--start-time START_TIME" in text and "TICKS" not in text
    assert "milliseconds since the epoch on Windows" in text
