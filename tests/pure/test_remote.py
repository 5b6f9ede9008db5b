"""`gpuguard --remote`'s pure parts: which host names reach ssh, the ssh argv and the one
quoted remote line, and what each kind of ssh reply means (tests/live/test_remote.py runs
them against private sshd hosts)."""

from __future__ import annotations

import json
import shlex

import pytest

from gpuguard.console.contract import (
    EXIT_NOT_CLEAN,
    EXIT_NVML_DOWN,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_REMOTE_NO_ANSWER,
    EXIT_REMOTE_UNREACHABLE,
    STATUS_SCHEMA,
)
from gpuguard.console.remote.answer import Failure, HostAnswer, Reply, judge, missing_key, worst
from gpuguard.console.remote.command import (
    SshSettings,
    option_problem,
    remote_line,
    ssh_argv,
    usage_problem,
)
from gpuguard.console.remote.hosts import HostError, from_file, from_lists, host_problem, unique

# -- host names --------------------------------------------------------------------------------


@pytest.mark.parametrize("host", [
    "node-07", "node07.example.org", "alice@node-07", "10.0.0.7", "[fe80::1%eth0]",
    "gpu_node", "ssh://alice@node-07:2222", "ssh://10.0.0.7",
])
def test_host_names_ssh_takes_pass(host: str) -> None:
    assert host_problem(host) is None


@pytest.mark.parametrize(("host", "why"), [
    ("-oProxyCommand=touch x", "starts with '-'"),
    ("-F/tmp/evil", "starts with '-'"),
    ("127.0.0.1;touch /tmp/x", "whitespace"),
    ("127.0.0.1;touch${IFS}/tmp/x", "contains"),
    ("node$(touch x)", "contains"),
    ("node`id`", "contains"),
    ("a|b", "contains"),
    ("node\x07", "control"),
    ("node\n-oProxyCommand=x", "control"),
    ("nöde", "contains"),
    ("", "empty"),
    ("ssh://", "contains"),
])
def test_host_names_that_could_be_options_or_reach_a_shell_are_refused(host: str,
                                                                        why: str) -> None:
    problem = host_problem(host)
    assert problem is not None and why in problem
    with pytest.raises(HostError) as refused:
        from_lists([host])
    assert "\n" not in str(refused.value) and str(refused.value).startswith("--remote: ")


def test_remote_lists_split_on_commas_in_order() -> None:
    assert from_lists(["a,b", "c", " d , e"]) == ["a", "b", "c", "d", "e"]
    with pytest.raises(HostError, match="empty"):
        from_lists(["a,,b"])
    assert unique(["a", "b", "a", "c", "b"]) == ["a", "b", "c"]


def test_hosts_file_one_per_line_with_comments() -> None:
    text = "# the A rack\nnode-01\n\n  node-02   # spare\n#node-03\nnode-04\n"
    assert from_file(text, "hosts.txt") == ["node-01", "node-02", "node-04"]
    with pytest.raises(HostError, match=r"^hosts.txt:2: refusing host 'a b'"):
        from_file("ok\na b\n", "hosts.txt")


# -- the ssh argv and the remote line ------------------------------------------------------------


def test_ssh_argv_ends_options_before_the_host_and_quotes_every_remote_word() -> None:
    settings = SshSettings(config_file="/tmp/cfg", options=("Port=2222",), connect_timeout=4.2,
                           remote_command=("sudo", "-n", "/opt/g g/bin/gpuguard"))
    args = ["123", "--config", "/etc/x; touch /tmp/pwned", "--start-time", "$(id)"]
    line = remote_line(settings, "reap", args)
    argv = ssh_argv(settings, "node-07", line)
    assert argv[:6] == ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
    assert argv[6:10] == ["-F", "/tmp/cfg", "-o", "Port=2222"]
    assert argv[-3:] == ["--", "node-07", line]
    # The remote shell splits the line back into exactly these words: nothing runs.
    assert shlex.split(line) == ["sudo", "-n", "/opt/g g/bin/gpuguard", "reap", "--json", *args]
    assert "StrictHostKeyChecking" not in " ".join(argv)


def test_json_goes_before_a_double_dash() -> None:
    line = remote_line(SshSettings(), "explain", ["--", "123"])
    assert shlex.split(line) == ["gpuguard", "explain", "--json", "--", "123"]


@pytest.mark.parametrize("option", ["StrictHostKeyChecking=no", "stricthostkeychecking off",
                                    "StrictHostKeyChecking=\"no\"", "BatchMode=no",
                                    "-oProxyCommand=x", "Port=22\nProxyCommand=x", "",
                                    # what ssh also reads as off (ssh -G: "false"), or
                                    # trusting every host on every run
                                    "StrictHostKeyChecking=false", "StrictHostKeyChecking=0",
                                    "UserKnownHostsFile=/dev/null",
                                    "GlobalKnownHostsFile /dev/null",
                                    "UserKnownHostsFile=none", "BatchMode=false"])
def test_ssh_options_that_weaken_ssh_are_refused(option: str) -> None:
    assert option_problem(option) is not None


@pytest.mark.parametrize("option", ["Port=2222", "IdentityFile=/k", "StrictHostKeyChecking=yes",
                                    "StrictHostKeyChecking=accept-new", "BatchMode=yes",
                                    "UserKnownHostsFile=/tmp/known_hosts"])
def test_ordinary_ssh_options_pass(option: str) -> None:
    assert option_problem(option) is None


def test_what_remote_refuses_before_asking() -> None:
    assert usage_problem("status", 2) is None
    assert usage_problem("reap", 1, apply=True) is None
    assert usage_problem("reap", 3) is None  # a dry run asks each
    for problem in (usage_problem("run", 1), usage_problem("status", 0),
                    usage_problem("status", 1, watch=True),
                    usage_problem("reap", 2, apply=True)):
        assert problem is not None


# -- what a reply means ------------------------------------------------------------------------


def status_doc(**changes: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "schema": STATUS_SCHEMA, "hostname": "node-07",
        "nvml": {"up": True, "driver_version": "550", "errors": []},
        "gpus": [{"index": 0, "name": "H100", "memory_used_bytes": 1,
                  "memory_total_bytes": 2}],
        "trees": [{"root_pid": 5, "root_start_time": 9, "root_user": "alice",
                   "root_comm": "sh", "verdict": "orphan", "reason": "launcher-killed",
                   "rule": "6", "gpu_bytes": 1, "orphan_age_seconds": None, "holders": []}]}
    doc.update(changes)
    return doc


def answer(code: int | None, out: str = "", err: str = "",
           subcommand: str = "status") -> HostAnswer:
    return judge("node-07", subcommand, Reply(code, out.encode(), err.encode()),
                 remote_command="gpuguard", timeout=30)


def test_a_document_is_rendered_with_the_remote_status() -> None:
    for code in (EXIT_OK, EXIT_NVML_DOWN):
        got = answer(code, json.dumps(status_doc()))
        assert (got.exit_code, got.failure, got.document) == (code, None, status_doc())


def test_each_failure_is_named() -> None:
    unreachable = answer(255, err="debug1: x\nssh: connect to host 10.0.0.7 port 22: "
                                  "Connection refused\n")
    assert (unreachable.failure, unreachable.exit_code) == (Failure.UNREACHABLE,
                                                            EXIT_REMOTE_UNREACHABLE)
    assert unreachable.detail == "ssh: connect to host 10.0.0.7 port 22: Connection refused"
    timed_out = answer(None)
    assert (timed_out.failure, timed_out.exit_code) == (Failure.TIMED_OUT,
                                                        EXIT_REMOTE_UNREACHABLE)
    missing = answer(127, err="bash: line 1: gpuguard: command not found")
    assert (missing.failure, missing.exit_code) == (Failure.NO_GPUGUARD, EXIT_REMOTE_NO_ANSWER)
    assert "gpuguard not found there (exit 127): bash" in missing.detail
    bad = answer(0, "Traceback (most recent call last):")
    assert (bad.failure, bad.exit_code) == (Failure.BAD_JSON, EXIT_REMOTE_NO_ANSWER)
    refused = answer(4, err="gpuguard: no such process: 123", subcommand="explain")
    assert (refused.failure, refused.exit_code) == (Failure.FAILED, 4)
    assert refused.detail == "exit 4: gpuguard: no such process: 123"


def test_an_older_document_names_the_key_it_lacks() -> None:
    doc = status_doc()
    del doc["trees"][0]["orphan_age_seconds"]  # type: ignore[index]
    older = answer(0, json.dumps(doc))
    assert (older.failure, older.exit_code) == (Failure.OLDER_GPUGUARD, EXIT_REMOTE_NO_ANSWER)
    assert "'trees[0].orphan_age_seconds'" in older.detail
    assert "'schema'" in answer(0, "{}").detail
    assert "gpuguard.status/v0" in answer(0, json.dumps(status_doc(schema="gpuguard.status/v0"))
                                          ).detail
    assert missing_key({"a": [{"b": 1}, {}]}, "a[].b") == "a[1].b"
    assert missing_key({"a": {"b": 1}}, "a.c") == "a.c"
    assert missing_key({"a": 3}, "a[].b") == "a[]"


def test_the_exit_status_is_the_worst_host() -> None:
    def of(*codes: int) -> int:
        return worst([HostAnswer(str(i), c) for i, c in enumerate(codes)])

    assert of() == EXIT_OK and of(EXIT_OK, EXIT_OK) == EXIT_OK
    assert of(EXIT_OK, EXIT_NOT_CLEAN) == EXIT_NOT_CLEAN
    assert of(EXIT_REFUSED, EXIT_REMOTE_NO_ANSWER, EXIT_OK) == EXIT_REMOTE_NO_ANSWER
    assert of(EXIT_REMOTE_NO_ANSWER, EXIT_REMOTE_UNREACHABLE) == EXIT_REMOTE_UNREACHABLE
