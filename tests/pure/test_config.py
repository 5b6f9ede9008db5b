"""Config validation: every error names file, key and problem."""

from __future__ import annotations

import time

import pytest

from gpuguard.base.validation import ConfigError
from gpuguard.config import load_config, parse_config
from gpuguard.config.remediate import AlertmanagerConfig, BasicAuth, PrometheusConfig
from gpuguard.orphans.rules_config import DEFAULT_PROTECT

FULL = """
classify:
  protect: [jupyter, 'my-.*-notebook']
  adopters: [systemd, tini]
  max_depth: 32
remediate:
  mode: enforce
  alerts: [GPUOrphanTree]
  reasons: [session-ended, parent-exited]
  min_age_seconds: 60
  users: {allow: ["*"], deny: [root, "svc-*"]}
  rate_limit: {max_reaps: 2, per_seconds: 600}
  term_timeout_seconds: 5
  state_dir: /tmp/x
  audit_log: /tmp/x/audit.jsonl
"""


def test_full_config_round_trips() -> None:
    cfg = parse_config(FULL, source="t.yml")
    assert cfg.classify.max_depth == 32 and cfg.classify.protects("MY-lab-NOTEBOOK")
    assert cfg.remediate.mode == "enforce"
    assert cfg.remediate.reasons == ("session-ended", "parent-exited")
    assert cfg.remediate.users.deny == ("root", "svc-*")
    assert cfg.remediate.rate_limit.max_reaps == 2


def test_users_take_uid_rules_beside_name_patterns() -> None:
    users = parse_config("remediate:\n  users: {allow: ['uid:1001', 'ml-*'], deny: "
                         "['uid:0', root]}").remediate.users
    assert users.allow == ("uid:1001", "ml-*") and users.deny == ("uid:0", "root")


def test_defaults_are_safe() -> None:
    cfg = load_config(None)
    # Only a death the kernel showed: session-ended (no listener could run) is evidence
    # of nothing, and an operator of a host without the connector opts in.
    assert cfg.remediate.mode == "dry-run" and cfg.remediate.reasons == ("launcher-killed",)
    assert cfg.classify.protect == DEFAULT_PROTECT and cfg.classify.max_depth == 64
    assert parse_config("").remediate.mode == "dry-run"


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("nope: 1", "nope", "unknown key"),
        ("classify: [1]", "classify", "must be a mapping"),
        ("classify:\n  protect: jupyter", "classify.protect", "must be a list of strings"),
        ("classify:\n  protect: ['[']", "classify.protect[0]", "bad regex"),
        ("classify:\n  max_depth: 0", "classify.max_depth", "must be >= 1"),
        ("remediate:\n  mode: kill", "remediate.mode", "must be one of"),
        ("remediate:\n  reasons: [protected]", "remediate.reasons", "'protected' is not one of"),
        ("remediate:\n  min_age_seconds: soon", "remediate.min_age_seconds", "must be a number"),
        ("remediate:\n  users: {allow: [a], block: [b]}", "remediate.users.block", "unknown key"),
        ("remediate:\n  users: {deny: [root, 1001]}", "remediate.users.deny[1]",
         'is a number: write "uid:1001"'),
        ("remediate:\n  users: {deny: ['1001']}", "remediate.users.deny[0]",
         'which no user name is: write "uid:1001"'),
        ("remediate:\n  users: {allow: ['uid:alice']}", "remediate.users.allow[0]",
         "is not a uid rule"),
        ("remediate:\n  users: {allow: ['uid:4294967295']}", "remediate.users.allow[0]",
         "from 0 to 4294967294"),
        ("remediate:\n  users: {allow: ['uid:' ]}", "remediate.users.allow[0]",
         "is not a uid rule"),
        ("remediate:\n  users: {allow: ['']}", "remediate.users.allow[0]", "empty pattern"),
        ("remediate:\n  rate_limit: {max_reaps: true}", "remediate.rate_limit.max_reaps",
         "must be an integer"),
        ("remediate:\n  allow_root_owned: yes please", "remediate.allow_root_owned",
         "must be true or false"),
        ("classify: {protect: [a]\n", "line", "invalid YAML"),
        ("- a\n- b\n", "(top level)", "must be a mapping"),
    ],
)
def test_errors_name_file_key_problem(text: str, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="/etc/gpuguard.yml")
    message = str(err.value)
    assert message.startswith("/etc/gpuguard.yml: ")
    assert key in message and problem in message, message


def test_unreadable_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yml")
    bad = tmp_path / "bin.yml"
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"bin.yml: \(file\): cannot read"):
        load_config(bad)


def test_alertmanager_section_is_optional_with_safe_defaults() -> None:
    assert parse_config("remediate: {mode: enforce}").remediate.alertmanager is None
    am = parse_config("remediate:\n  alertmanager: {url: 'http://127.0.0.1:9093'}"
                      ).remediate.alertmanager
    assert am == AlertmanagerConfig(url=("http://127.0.0.1:9093",))
    assert am.credentials_file is None and am.timeout_seconds == 3.0
    assert am.pull is False and am.pull_interval_seconds == 15.0


def test_alertmanager_section_full(tmp_path) -> None:
    path = tmp_path / "gpuguard.yml"
    path.write_text("""
remediate:
  alertmanager:
    url: ['https://am-0.example:9093/', 'https://[::1]:9443/alertmanager']
    credentials_file: /etc/gpuguard/am-token
    ca_file: /etc/gpuguard/alertmanager-ca.crt
    timeout_seconds: 0.5
    pull: true
    pull_interval_seconds: 1
""")
    am = load_config(path).remediate.alertmanager
    assert am == AlertmanagerConfig(
        url=("https://am-0.example:9093/", "https://[::1]:9443/alertmanager"),
        credentials_file="/etc/gpuguard/am-token", timeout_seconds=0.5, pull=True,
        pull_interval_seconds=1.0, ca_file="/etc/gpuguard/alertmanager-ca.crt")
    assert isinstance(am.url, tuple) and isinstance(am.pull_interval_seconds, float)
    assert am.insecure_credentials_over_http is False


@pytest.mark.parametrize("url", ["http://127.0.0.1:9093",  # the old shipped example
                                 "['https://am-0.example:9093', 'HTTP://am-1.example:9093']"])
def test_a_token_over_plain_http_is_refused(url: str) -> None:
    """Issue 48: while Alertmanager is not listening, any local user who binds 9093 got
    `Authorization: Bearer ...` on every poll, and could answer the confirmation."""
    text = f"remediate:\n  alertmanager:\n    url: {url}\n    credentials_file: /t\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="/etc/gpuguard.yml")
    assert str(err.value).startswith(
        f"/etc/gpuguard.yml: {AM}.credentials_file: would be sent in clear to ")
    assert "insecure_credentials_over_http" in err.value.problem


def test_a_token_over_plain_http_needs_the_explicit_opt_out() -> None:
    am = parse_config("remediate:\n  alertmanager:\n    url: http://127.0.0.1:9093\n"
                      "    credentials_file: /t\n    insecure_credentials_over_http: true\n"
                      ).remediate.alertmanager
    assert am is not None and am.insecure_credentials_over_http and am.credentials_file == "/t"
    # Plain http without a token is not a token in clear (the remediator warns at start).
    assert parse_config("remediate:\n  alertmanager: {url: 'http://127.0.0.1:9093'}\n"
                        ).remediate.alertmanager is not None


AM = "remediate.alertmanager"


@pytest.mark.parametrize(
    ("body", "key", "problem"),
    [
        ("{}", f"{AM}.url", "required"),
        ("", f"{AM}.url", "required"),
        ("[http://a]", AM, "must be a mapping"),
        ("{url: http://a, urls: [http://b]}", f"{AM}.urls", "unknown key"),
        ("{url: []}", f"{AM}.url", "non-empty list of URLs, got an empty list"),
        ("{url: 9093}", f"{AM}.url", "non-empty list of URLs, got an integer"),
        ("{url: {a: b}}", f"{AM}.url", "non-empty list of URLs, got a mapping"),
        ("{url: ''}", f"{AM}.url", "must be a non-empty string"),
        ("{url: [http://a, 5]}", f"{AM}.url[1]", "must be a non-empty string, got an integer"),
        ("{url: [http://a, '']}", f"{AM}.url[1]", "must be a non-empty string"),
        ("{url: [http://a, 'ftp://b']}", f"{AM}.url[1]", "must be an http:// or https:// URL"),
        ("{url: 'localhost:9093'}", f"{AM}.url", "must be an http:// or https:// URL"),
        ("{url: 'http://'}", f"{AM}.url", "with a host"),
        ("{url: 'http:///api'}", f"{AM}.url", "with a host"),
        ("{url: 'http://a:99999'}", f"{AM}.url", "not a valid URL"),
        ("{url: 'http://a:port'}", f"{AM}.url", "not a valid URL"),
        ("{url: 'http://a/?x=1'}", f"{AM}.url", "must not have a query or fragment"),
        ("{url: 'http://a/#top'}", f"{AM}.url", "must not have a query or fragment"),
        ("{url: 'http://u:p@a'}", f"{AM}.url", "must not carry credentials"),
        ("{url: 'http://a b:9093'}", f"{AM}.url", "must not contain spaces"),
        ("{url: http://a, credentials_file: ''}", f"{AM}.credentials_file",
         "must be a non-empty string"),
        ("{url: http://a, ca_file: /ca.crt}", f"{AM}.ca_file",
         "only https:// URLs use it"),
        ("{url: https://a, ca_file: ''}", f"{AM}.ca_file", "must be a non-empty string"),
        ("{url: http://a, insecure_credentials_over_http: yes please}",
         f"{AM}.insecure_credentials_over_http", "must be true or false"),
        ("{url: http://a, credentials_file: [a]}", f"{AM}.credentials_file",
         "must be a non-empty string, got a list"),
        ("{url: http://a, timeout_seconds: 0}", f"{AM}.timeout_seconds", "must be > 0"),
        ("{url: http://a, timeout_seconds: -1}", f"{AM}.timeout_seconds", "must be > 0"),
        ("{url: http://a, timeout_seconds: .nan}", f"{AM}.timeout_seconds",
         "must be a finite number"),
        ("{url: http://a, timeout_seconds: .inf}", f"{AM}.timeout_seconds",
         "must be a finite number"),
        ("{url: http://a, timeout_seconds: 3s}", f"{AM}.timeout_seconds",
         "must be a number, got a string"),
        ("{url: http://a, timeout_seconds: true}", f"{AM}.timeout_seconds",
         "must be a number, got a boolean"),
        ("{url: http://a, pull: sometimes}", f"{AM}.pull", "must be true or false"),
        ("{url: http://a, pull: 1}", f"{AM}.pull", "must be true or false"),
        ("{url: http://a, pull_interval_seconds: 0.5}", f"{AM}.pull_interval_seconds",
         "must be >= 1"),
        ("{url: http://a, pull_interval_seconds: .nan}", f"{AM}.pull_interval_seconds",
         "must be a finite number"),
        ("{url: http://a, pull_interval_seconds: -.inf}", f"{AM}.pull_interval_seconds",
         "must be a finite number"),
        ("{url: http://a, pull_interval_seconds: null}", f"{AM}.pull_interval_seconds",
         "must be a number, got nothing"),
    ],
)
def test_alertmanager_errors_name_file_and_key(body: str, key: str, problem: str) -> None:
    text = f"remediate:\n  alertmanager: {body}\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="/etc/gpuguard.yml")
    assert err.value.path == "/etc/gpuguard.yml" and err.value.key == key, str(err.value)
    assert problem in err.value.problem, str(err.value)
    assert str(err.value).startswith(f"/etc/gpuguard.yml: {key}: ")


@pytest.mark.parametrize("key", ["min_age_seconds", "term_timeout_seconds",
                                 "worker_timeout_seconds", "rate_limit.per_seconds"])
@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_non_finite_numbers_are_errors(key: str, value: str) -> None:
    """NaN passes every comparison: `min_age_seconds: .nan` once meant "reap at first sight"."""
    section, _, leaf = key.rpartition(".")
    body = f"{{{leaf}: {value}}}" if not section else f"{{{section}: {{{leaf}: {value}}}}}"
    with pytest.raises(ConfigError) as err:
        parse_config(f"remediate: {body}\n", source="t.yml")
    assert err.value.key == f"remediate.{key}" and "finite" in err.value.problem


def test_a_key_a_merge_brings_in_and_the_mapping_sets_again_is_a_duplicate() -> None:
    """YAML says the mapping's own key wins, but a reader sees `mode` twice: refused."""
    with pytest.raises(ConfigError) as err:
        parse_config("base: &b {mode: dry-run}\nremediate:\n  <<: *b\n  mode: enforce\n",
                     source="t.yml")
    assert err.value.key == "remediate.mode" and "lines 1 and 4" in err.value.problem
    assert "<< merge on line 3" in err.value.problem


@pytest.mark.parametrize("text", [
    # The review's: PyYAML loads the last source's (the YAML spec says the first's).
    "remediate:\n  <<: [{mode: dry-run}, {mode: enforce}]\n",
    "remediate:\n  <<: {mode: dry-run}\n  <<: {mode: enforce}\n",
    # A merge source that merges the key in turn, set again by the mapping.
    "a: &a {mode: dry-run}\nb: &b {<<: *a, min_age_seconds: 60}\n"
    "remediate: {<<: *b, mode: enforce}\n",
    # Two sources, one of which brings the key through its own merge.
    "a: &a {mode: dry-run}\nb: &b {<<: *a}\nremediate: {<<: [*b, {mode: enforce}]}\n",
    # A duplicate inside a merge source written in place.
    "remediate:\n  <<: {mode: dry-run, mode: enforce}\n",
])
def test_a_merge_that_gives_a_key_twice_is_a_duplicate(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="/etc/gpuguard.yml")
    assert err.value.key == "remediate.mode" and "duplicate key" in err.value.problem, \
        str(err.value)
    assert str(err.value).startswith("/etc/gpuguard.yml: remediate.mode: duplicate key")


def test_merges_that_give_each_key_once_still_load() -> None:
    """The same key node reached by two paths (one anchor merged twice) is one key."""
    cfg = parse_config("remediate:\n  <<: [{mode: enforce}, {min_age_seconds: 60}]\n")
    assert (cfg.remediate.mode, cfg.remediate.min_age_seconds) == ("enforce", 60)
    twice = ("remediate:\n  users: &u {allow: [alice]}\n  rate_limit: {max_reaps: 2}\n"
             "  alertmanager: {url: 'http://a', <<: {}}\n"
             "classify: {<<: [&p {protect: [x]}, *p]}\n")
    assert parse_config(twice).classify.protect == ("x",)


def test_aliases_are_walked_once() -> None:
    """A self-referencing alias and a 'billion laughs' chain: one clear line, at once."""
    laughs = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi",
                                                                    strict=True))
    for text in ("remediate:\n  users: &u {allow: [*u]}\n", laughs):
        started = time.monotonic()
        with pytest.raises(ConfigError):
            parse_config(text, source="t.yml")
        assert time.monotonic() - started < 2.0


def test_adopters_keeps_its_old_name_reapers() -> None:
    assert parse_config("classify:\n  adopters: [tini]").classify.adopters == ("tini",)
    assert parse_config("classify:\n  reapers: [tini]").classify.adopters == ("tini",)
    with pytest.raises(ConfigError) as err:
        parse_config("classify:\n  adopters: [tini]\n  reapers: [tini]", source="t.yml")
    assert str(err.value) == ("t.yml: classify.reapers: is the old name of adopters: "
                              "give one of the two")


ACCOUNTING = """
quotas:
  users: {alice: 10GiB, "*": "8 GB", bob: 1073741824}
  groups: {students: 12GiB}
audit:
  suspect_names: [xmrig, minerd]
  suspect_patterns: [xmrig, '^cryptonight']
  sustained_utilization: {ratio: 0.9, for_seconds: 1800}
"""


def test_quotas_and_audit_sections() -> None:
    cfg = parse_config(ACCOUNTING, source="t.yml")
    assert dict(cfg.quotas.users) == {"alice": 10 * 2**30, "*": 8 * 10**9, "bob": 2**30}
    assert dict(cfg.quotas.groups) == {"students": 12 * 2**30}
    assert cfg.audit.suspect_names == ("xmrig", "minerd")
    assert cfg.audit.suspect_patterns == ("xmrig", "^cryptonight")
    assert cfg.audit.suspect("bash", "cryptonight -t 4") is not None
    assert cfg.audit.suspect("minerd", None) is not None
    assert cfg.audit.suspect("ethminer", "ethminer -G") is None  # the names were replaced
    # A user's pattern is searched anywhere, as before; a name is not.
    assert cfg.audit.suspect("python", "python tools/xmrig_detector.py") is not None
    assert parse_config("audit:\n  suspect_names: [xmrig]").audit.suspect(
        "python", "python tools/xmrig_detector.py") is None
    rule = cfg.audit.sustained_utilization
    assert rule is not None and (rule.ratio, rule.for_seconds) == (0.9, 1800)


def test_accounting_defaults_no_quota_miner_patterns_heuristic_off() -> None:
    cfg = parse_config("audit:\n  sustained_utilization:\n", source="t.yml")
    assert cfg.quotas.users == () and cfg.quotas.groups == ()
    assert "xmrig" in cfg.audit.suspect_names and cfg.audit.sustained_utilization is None
    assert any("stratum" in p for p in cfg.audit.suspect_patterns)
    on = parse_config("audit:\n  sustained_utilization: {}\n").audit.sustained_utilization
    assert on is not None and (on.ratio, on.for_seconds) == (0.95, 3600)


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("quotas: [a]", "quotas", "must be a mapping"),
        ("quotas:\n  people: {a: 1GiB}", "quotas.people", "unknown key"),
        ("quotas:\n  users: [alice]", "quotas.users", "must be a mapping of names to sizes"),
        ("quotas:\n  users: {alice: 10G}", "quotas.users.alice", "unknown unit 'G'"),
        ("quotas:\n  users: {alice: 10 gb}", "quotas.users.alice", "unknown unit 'gb'"),
        ("quotas:\n  users: {alice: '10'}", "quotas.users.alice", "is not a size"),
        ("quotas:\n  users: {alice: 1.5}", "quotas.users.alice",
         "must be an integer number of bytes"),
        ("quotas:\n  users: {alice: -1}", "quotas.users.alice", "must be >= 0"),
        ("quotas:\n  users: {1000: 1GiB}", "quotas.users.1000", "quote numeric names"),
        ("quotas:\n  groups: {'*': 1GiB}", "quotas.groups.*", "the default quota is users."),
        ("quotas:\n  users: {alice: 1GiB, alice: 2GiB}", "quotas.users.alice",
         "duplicate key"),
        ("audit:\n  suspect_patterns: xmrig", "audit.suspect_patterns",
         "must be a list of strings"),
        ("audit:\n  suspect_patterns: ['(x)\\1']", "audit.suspect_patterns[0]",
         "bad regex"),  # a back-reference: RE2 has none
        ("audit:\n  sustained_utilization: {ratio: 95}", "audit.sustained_utilization.ratio",
         "must be a ratio in (0, 1]"),
        ("audit:\n  sustained_utilization: {ratio: 0}", "audit.sustained_utilization.ratio",
         "must be > 0"),
        ("audit:\n  sustained_utilization: {for_seconds: .inf}",
         "audit.sustained_utilization.for_seconds", "must be a finite number"),
        ("audit:\n  sustained_utilization: {window: 3}", "audit.sustained_utilization.window",
         "unknown key"),
        ("audit:\n  miners: [x]", "audit.miners", "unknown key"),
        ("audit:\n  suspect_names: xmrig", "audit.suspect_names", "must be a list of strings"),
        ("audit:\n  suspect_names: [/opt/xmrig]", "audit.suspect_names[0]",
         "is not a program name"),
        ("audit:\n  suspect_names: [ok, 'two words']", "audit.suspect_names[1]",
         "is not a program name"),
        ("audit:\n  suspect_names: ['']", "audit.suspect_names[0]", "is not a program name"),
        ("accounting: [a]", "accounting", "must be a mapping"),
        ("accounting:\n  threshold: 1", "accounting.threshold", "unknown key"),
        ("accounting:\n  unlisted_threshold_bytes: 1G", "accounting.unlisted_threshold_bytes",
         "unknown unit 'G'"),
        ("accounting:\n  device_files: /dev/nvidia0", "accounting.device_files",
         "must be a list of strings"),
        ("accounting:\n  device_files: [dev/nvidia0]", "accounting.device_files[0]",
         "not an absolute path pattern"),
        ("accounting:\n  unlisted_search_budget_processes: 0",
         "accounting.unlisted_search_budget_processes", "must be >= 1"),
        ("accounting:\n  unlisted_search_budget_milliseconds: 0",
         "accounting.unlisted_search_budget_milliseconds", "must be > 0"),
        ("accounting:\n  unlisted_search_budget_milliseconds: .inf",
         "accounting.unlisted_search_budget_milliseconds", "must be a finite number"),
    ],
)
def test_accounting_errors_name_file_key_problem(text: str, key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="/etc/gpuguard.yml")
    message = str(err.value)
    assert message.startswith(f"/etc/gpuguard.yml: {key}: "), message
    assert problem in message, message


def test_the_accounting_section_and_its_defaults() -> None:
    from gpuguard.config.accounting import UnlistedSettings

    assert parse_config("").accounting.unlisted == UnlistedSettings()
    assert UnlistedSettings().device_files == ("/dev/nvidia[0-9]*",)
    cfg = parse_config("accounting:\n  unlisted_threshold_bytes: 1GiB\n"
                       "  device_files: ['/dev/nvidia[0-9]*', /srv/fake/gpu*]\n"
                       "  unlisted_search_budget_processes: 10\n"
                       "  unlisted_search_budget_milliseconds: 2.5\n")
    assert cfg.accounting.unlisted == UnlistedSettings(
        2**30, ("/dev/nvidia[0-9]*", "/srv/fake/gpu*"), 10, 2.5)
    assert cfg.accounting.idle.idle_after_seconds == 3600


def test_one_accounting_section_serves_idle_time_and_the_unlisted_search() -> None:
    cfg = parse_config("accounting:\n  idle_after_seconds: 60\n"
                       "  unlisted_threshold_bytes: 1GiB\n")
    assert cfg.accounting.idle.idle_after_seconds == 60
    assert cfg.accounting.unlisted.unlisted_threshold_bytes == 2**30
    assert cfg.accounting.unlisted.device_files == ("/dev/nvidia[0-9]*",)



PROM = "remediate.prometheus"
WITH_AM = "  alertmanager: {url: 'https://am:9093'}\n"


def test_prometheus_pull_section_full() -> None:
    """Issue 54: Prometheus pull, configured like Alertmanager's (URL, TLS, auth, interval)."""
    prom = parse_config("remediate:\n" + WITH_AM + """\
  prometheus:
    url: [https://prom-1:9090, https://prom-2:9090/prometheus]
    basic_auth: {username: gpuguard, password_file: /etc/gpuguard/prom-password}
    ca_file: /etc/gpuguard/prometheus-ca.crt
    timeout_seconds: 2
    pull_interval_seconds: 30
""").remediate.prometheus
    assert prom == PrometheusConfig(
        url=("https://prom-1:9090", "https://prom-2:9090/prometheus"),
        basic_auth=BasicAuth("gpuguard", "/etc/gpuguard/prom-password"),
        ca_file="/etc/gpuguard/prometheus-ca.crt", timeout_seconds=2.0,
        pull_interval_seconds=30.0)
    assert parse_config("remediate: {mode: enforce}").remediate.prometheus is None


@pytest.mark.parametrize(
    ("body", "key", "problem"),
    [
        ("{}", f"{PROM}.url", "required"),
        ("{url: 'ftp://p'}", f"{PROM}.url", "must be an http:// or https:// URL"),
        ("{url: 'http://u:p@p'}", f"{PROM}.url", "must not carry credentials"),
        ("{url: http://p, credentials_file: /t}", f"{PROM}.credentials_file",
         "would be sent in clear to http://p"),
        ("{url: http://p, basic_auth: {username: u, password_file: /p}}", f"{PROM}.basic_auth",
         "would be sent in clear to http://p"),
        ("{url: https://p, credentials_file: /t, basic_auth: {username: u, password_file: /p}}",
         f"{PROM}.basic_auth", "exclude each other"),
        ("{url: https://p, basic_auth: {username: u}}", f"{PROM}.basic_auth.password_file",
         "required"),
        ("{url: https://p, basic_auth: {username: 'a:b', password_file: /p}}",
         f"{PROM}.basic_auth.username", "must not contain ':'"),
        ("{url: https://p, basic_auth: {username: u, password: hunter2}}",
         f"{PROM}.basic_auth.password", "unknown key"),
        ("{url: http://p, ca_file: /ca.crt}", f"{PROM}.ca_file", "only https:// URLs use it"),
        ("{url: http://p, pull_interval_seconds: 0.5}", f"{PROM}.pull_interval_seconds",
         "must be >= 1"),
        ("{url: http://p, timeout_seconds: 0}", f"{PROM}.timeout_seconds", "must be > 0"),
        ("{url: http://p, pull: true}", f"{PROM}.pull", "unknown key"),
    ],
)
def test_prometheus_errors_name_file_and_key(body: str, key: str, problem: str) -> None:
    text = f"remediate:\n{WITH_AM}  prometheus: {body}\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="/etc/gpuguard.yml")
    assert err.value.path == "/etc/gpuguard.yml" and err.value.key == key, str(err.value)
    assert problem in err.value.problem, str(err.value)


@pytest.mark.parametrize(
    ("alertmanager", "problem"),
    [
        ("", "needs remediate.alertmanager"),  # no confirmation: silences would not count
        ("  alertmanager: {url: 'https://am:9093', pull: true}\n", "choose one"),
    ],
)
def test_prometheus_pull_needs_alertmanager_and_is_the_only_pull(alertmanager: str,
                                                                 problem: str) -> None:
    text = f"remediate:\n{alertmanager}  prometheus: {{url: 'https://prom:9090'}}\n"
    with pytest.raises(ConfigError) as err:
        parse_config(text, source="/etc/gpuguard.yml")
    assert err.value.key == PROM and problem in err.value.problem, str(err.value)
    assert "\n" not in str(err.value)
