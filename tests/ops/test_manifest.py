"""Job manifests: rendering (golden file, supervisor's own parser), validation errors, secrets."""
import hashlib
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ds_trhash.cli import main as cli_main
from ds_trhash.ops.manifest import ManifestError, load_manifest
from ds_trhash.ops.render import render_config, write_config

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).resolve().parents[2]
SECRET_VALUE = "hf_s3cr3t-VALUE-never-shown"


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ds_trhash.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


def tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def golden_manifest(tmp_path) -> Path:
    path = tmp_path / "pipeline.toml"
    path.write_text((GOLDEN / "pipeline.toml").read_text())
    (tmp_path / "work").mkdir(exist_ok=True)  # the jobs' directory: it must exist
    return path


def normalized(text: str, tmp_path: Path) -> str:
    return text.replace(sys.executable, "@PYTHON@").replace(str(tmp_path), "@DIR@")


def test_render_through_the_cli_matches_the_golden_file(tmp_path):
    manifest = golden_manifest(tmp_path)
    proc = cli("jobs", "render", str(manifest), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    config = tmp_path / "out" / "supervisord.conf"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert normalized(config.read_text(), tmp_path) == (GOLDEN / "supervisord.conf").read_text()
    # deterministic: rendering again writes the same bytes (and leaves no temporary behind)
    before = config.read_bytes()
    write_config(load_manifest(manifest), tmp_path / "out")
    assert config.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs", "supervisord.conf"]


def test_supervisor_reads_back_every_argv_element_and_environment_value(tmp_path):
    """supervisor's own parser (ServerOptions) and its own command splitting see the manifest's values."""
    from supervisor.options import ServerOptions

    manifest = load_manifest(golden_manifest(tmp_path))
    config = write_config(manifest, tmp_path / "out")
    options = ServerOptions()
    options.configfile = str(config)
    options.process_config(do_usage=False)
    programs = {g.name: g.process_configs[0] for g in options.process_group_configs}
    assert set(programs) == {"pretrain", "refine", "watch", "_after"}
    watch = programs["watch"]
    assert shlex.split(watch.command) == ["env", "-u", "HF_TOKEN", "--", *manifest.job("watch").argv]
    assert watch.environment == {"GREETING": "hello, world = 100%"}
    pre = programs["pretrain"]
    assert shlex.split(pre.command) == list(manifest.job("pretrain").argv)
    assert pre.environment == {"OMP_NUM_THREADS": "8", "NCCL_DEBUG": "WARN", "RESUME": "auto"}  # training job
    assert pre.directory == str(tmp_path / "work") and pre.stopasgroup and pre.killasgroup
    # refine does not inherit HF_TOKEN: supervisord holds it for pretrain only, so refine runs behind env -u
    assert shlex.split(programs["refine"].command)[:4] == ["env", "-u", "HF_TOKEN", "--"]
    assert programs["refine"].autostart is False  # started by the _after listener once pretrain exits 0
    assert programs["refine"].stdout_logfile == str(tmp_path / "logs" / "refine.log")


BAD = [
    ("version = 2\n[[jobs]]\nname='a'\nargv=['x']\n", "key 'version': 2 is not supported; allowed: 1"),
    ("version = 1\n", "key 'jobs': is required"),
    ("version = 1\nnice = 3\n[[jobs]]\nname='a'\nargv=['x']\n", "key 'nice': unknown key; allowed keys: version"),
    ("version = 1\n[[jobs]]\nname='a'\nargv='python train.py'\n", "job 'a': key 'argv': must be a list of strings, "
                                                                   "never a shell string"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x', 3]\n", "job 'a': key 'argv': element 1 must be a string"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=[]\n", "job 'a': key 'argv': must name a program"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x']\nrestart='sometimes'\n",
     "job 'a': key 'restart': 'sometimes' is not allowed; allowed: on-failure, always, never"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x']\ncron='daily'\n", "job 'a': key 'cron': unknown key; allowed keys"),
    ("version = 1\n[[jobs]]\nname='a b'\nargv=['x']\n", "key 'name': 'a b' must be 1-64 of [A-Za-z0-9_.-]"),
    ("version = 1\n[[jobs]]\nargv=['x']\n", "jobs[0]: key 'name': is required"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x']\n[[jobs]]\nname='a'\nargv=['y']\n", "two jobs share this name"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x']\nafter=['b']\n", "job 'a': key 'after': no job is named 'b'"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x']\nafter=['b']\n[[jobs]]\nname='b'\nargv=['x']\nafter=['a']\n",
     "the order has a cycle: a -> b -> a"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x']\nrestart='always'\n[[jobs]]\nname='b'\nargv=['x']\nafter=['a']\n",
     "'a' has restart = \"always\" and never finishes"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x', \"two\\nlines\"]\n", "cannot carry line breaks"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x']\nenvironment={N=8}\n", "N must be a string (quote it"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['launch/train.py']\nenvironment={RESUME='never'}\n",
     "a training job always runs with RESUME=auto"),
    ("version = 1\n[[jobs]]\nname='a'\nargv=['x']\nkind='service'\n", "allowed: training, command"),
    ("version = 1\n[[jobs]\n", "not valid TOML"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m[:40] for _, m in BAD])
def test_validation_errors_name_file_job_key_and_allowed_values(tmp_path, text, message):
    path = tmp_path / "jobs.toml"
    path.write_text(text)
    with pytest.raises(ManifestError) as err:
        load_manifest(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_a_bad_manifest_exits_2_without_a_traceback_and_writes_nothing(tmp_path):
    path = tmp_path / "jobs.toml"
    path.write_text("version = 1\n[[jobs]]\nname='a'\nargv='deepspeed launch/train.py'\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "supervisord.conf").write_text("; an earlier render\n")
    before = tree_hash(tmp_path)
    proc = cli("jobs", "render", str(path), "--out", str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "job 'a': key 'argv': must be a list of strings" in proc.stderr
    assert tree_hash(tmp_path) == before


def test_a_secret_in_environment_is_refused_without_echoing_its_value(tmp_path):
    path = tmp_path / "jobs.toml"
    path.write_text(f"version = 1\n[[jobs]]\nname='train'\nargv=['launch/train.py']\n"
                    f"environment = {{ OMP_NUM_THREADS = '1', hf_api_key = '{SECRET_VALUE}' }}\n")
    before = tree_hash(tmp_path)
    proc = cli("jobs", "render", str(path), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert SECRET_VALUE not in proc.stdout + proc.stderr
    assert "hf_api_key looks like a secret" in proc.stderr and 'inherit_environment = ["hf_api_key"]' in proc.stderr
    assert tree_hash(tmp_path) == before  # nothing rendered


def test_supervisord_gets_only_the_secrets_a_job_inherits(tmp_path):
    from ds_trhash.ops.jobs import supervisord_environment

    path = tmp_path / "jobs.toml"
    path.write_text("version = 1\n[[jobs]]\nname='push'\nargv=['true']\ninherit_environment=['HF_TOKEN']\n")
    manifest = load_manifest(path)
    with pytest.raises(ManifestError, match="HF_TOKEN is not set in the environment of `ds-trhash jobs up`"):
        supervisord_environment(manifest, {"PATH": "/bin"})
    env = supervisord_environment(manifest, {"PATH": "/bin", "HF_TOKEN": "t", "WANDB_API_KEY": "w", "DB_PASSWORD": "p"})
    assert env == {"PATH": "/bin", "HF_TOKEN": "t"}


def test_rendering_refuses_values_supervisord_cannot_hold(tmp_path):
    path = tmp_path / "jobs.toml"
    path.write_text("version = 1\n[[jobs]]\nname='a'\nargv=['x']\nenvironment={ Q = \"both ' and \\\"\" }\n")
    with pytest.raises(ManifestError, match="cannot hold both quote kinds") as err:
        load_manifest(path)
    assert "both ' and" not in str(err.value)
    short = load_manifest(golden_manifest(tmp_path))
    with pytest.raises(ManifestError, match="too deep for a unix socket"):
        render_config(short, tmp_path / ("d" * 120))


def test_the_shipped_demo_manifest_loads_and_renders(tmp_path):
    manifest = load_manifest(REPO / "ds_configs" / "jobs" / "tiny.toml")
    assert [(j.name, j.kind, j.after) for j in manifest.jobs] == [
        ("pretrain", "training", ()), ("refine", "training", ("pretrain",)), ("sft", "training", ("refine",)),
        ("report", "command", ("sft",))]
    assert all(j.directory == REPO for j in manifest.jobs) and manifest.jobs_dir == REPO / "runs" / "jobs-tiny"
    assert "[program:sft]" in render_config(manifest, tmp_path)


TOKENS = ["hf_" + "aBcDeFgHiJkLmNoPqRsTuVwXyZ012345", "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8",
          "Zx8Qp2Lm4Nv6Bc1Hd9Kj3Fg7Tr5Ws0Ye8Ua2Io4Ep6Rb"]


@pytest.mark.parametrize("value", TOKENS, ids=["hf", "github", "high-entropy"])
def test_a_token_under_a_harmless_name_is_refused_by_value_without_echoing_it(tmp_path, value, capsys):
    env = tmp_path / "env.toml"
    env.write_text(f"version = 1\n[[jobs]]\nname='push'\nargv=['true']\nenvironment = {{ HF_AUTH = '{value}' }}\n")
    argv = tmp_path / "argv.toml"
    argv.write_text(f"version = 1\n[[jobs]]\nname='push'\nargv=['true', '--token={value}']\n")
    before = tree_hash(tmp_path)
    if value.startswith("hf_"):  # once through the command (in-process); the other kinds at the loader
        assert cli_main(["jobs", "render", str(env), "--out", str(tmp_path / "out")]) == 2
        out, err = capsys.readouterr()
        assert value not in out + err and "Traceback" not in err
        assert "variable HF_AUTH (value not shown) looks like an access token" in err
    with pytest.raises(ManifestError, match="HF_AUTH .value not shown. looks like an access token") as err:
        load_manifest(env)
    assert value not in str(err.value)
    with pytest.raises(ManifestError, match="'argv' element 1 .value not shown. looks like an access token") as err:
        load_manifest(argv)
    assert value not in str(err.value)
    assert tree_hash(tmp_path) == before


def test_digests_paths_and_words_are_not_taken_for_tokens(tmp_path):
    path = tmp_path / "jobs.toml"
    digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    path.write_text("version = 1\n[[jobs]]\nname='a'\nargv=['true']\nenvironment = { "
                    f"SHA = '{digest}', P = '/data/runs/tiny-pretrain/checkpoints/step_00000002', "
                    "W = 'transformers_offline_mode_enabled_for_this_job' }\n")
    assert dict(load_manifest(path).jobs[0].environment)["SHA"] == digest


def test_a_job_directory_that_does_not_exist_is_refused_naming_the_key(tmp_path, capsys):
    path = tmp_path / "jobs.toml"
    path.write_text("version = 1\n[[jobs]]\nname='a'\nargv=['true']\ndirectory='nowhere'\n")
    before = tree_hash(tmp_path)
    assert cli_main(["jobs", "render", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"job 'a': key 'directory': {tmp_path / 'nowhere'} does not exist" in err and "Traceback" not in err
    assert tree_hash(tmp_path) == before
