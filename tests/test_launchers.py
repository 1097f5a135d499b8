"""Engines through real launchers: Slurm, Open MPI and SSH on this machine, no mocks.

Each test attaches 2 engines through the launcher and checks a dp=2 step against the
single-process reference; the failure tests check that a launch that cannot work ends in a
LabError quoting the launcher, within a bounded time, and leaves nothing running. On CI,
`scripts/ci_services.sh start` (called by .ci/run) installs and starts what they need; on a
machine without Slurm, mpirun or sshd they skip and say why.
"""
from __future__ import annotations

import functools
import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import labkit
from labkit.errors import LabError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
LOCAL = dict(controller_ip="127.0.0.1", progress=False, start_timeout=90)


@functools.lru_cache(maxsize=None)
def _slurm_missing() -> str | None:
    """None when a Slurm controller answers here, else why not."""
    if not shutil.which("sbatch"):
        return "no sbatch (Slurm client) on this machine; `sudo bash scripts/ci_services.sh start` installs it"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%a %T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s"
    if done.returncode or "up" not in done.stdout:
        return f"no Slurm controller answering ({(done.stderr or done.stdout).strip()[:200]})"
    return None


def _mpi_missing() -> str | None:
    return None if shutil.which("mpiexec") else "no mpiexec (Open MPI) on this machine"


def _ssh_missing() -> str | None:
    if not (shutil.which("sshd") or os.path.exists("/usr/sbin/sshd")) or not shutil.which("ssh"):
        return "no sshd/ssh (openssh-server) on this machine"
    if not os.path.isdir("/run/sshd") and os.geteuid() != 0:
        return "sshd needs /run/sshd (its privilege-separation folder); create it as root"
    return None


def _require(missing: str | None) -> None:
    """Skip where the service is absent (a laptop); on CI, where .ci/run provides it, fail."""
    if missing and os.environ.get("CI"):
        pytest.fail(f"{missing} — on CI, scripts/ci_services.sh start must provide it")
    if missing:
        pytest.skip(missing)


@pytest.fixture
def slurm():
    _require(_slurm_missing())


@pytest.fixture
def mpi():
    _require(_mpi_missing())


def _mpi_env() -> dict:
    return dict(AS_ROOT) if os.geteuid() == 0 else {}


def _check_dp_step(lab, source: str) -> None:
    """The device map came from the launcher, and one dp=2 run equals the reference."""
    assert [r["rank"] for r in lab.ranks] == [0, 1]
    assert {r["rank_source"] for r in lab.ranks} == {source}
    assert [r["local_rank"] for r in lab.ranks] == [0, 1]           # both on this host
    assert all(r["device"] == "cpu" and r["backend"] == "gloo" for r in lab.ranks)
    assert "rank 1" in repr(lab) and "<td>cpu</td>" in lab._repr_html_()
    model = labkit.models.mlp(width=32, depth=2)
    run = lab.run(labkit.Strategy(dp=2), model=model, batch=8, steps=2, seed=1)
    ref = labkit.reference(model, batch=8, steps=2, seed=1)
    assert run.max_diff(ref) <= 1e-5
    assert run.losses == pytest.approx(ref.losses, abs=1e-5)


def _squeue() -> str:
    return subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True).stdout.strip()


# -- Slurm ------------------------------------------------------------------------------------
def test_slurm_engines_run_a_dp_step(slurm):
    with labkit.Lab.start(engines=2, launcher="slurm", timeout=60, time_limit="10", **LOCAL) as lab:
        _check_dp_step(lab, "slurm")
        job = lab.cluster.engines and next(iter(lab.cluster.engines.values())).job_id
        assert job in _squeue()
    assert job not in _squeue()                   # cancelled and gone when the lab closes


def test_slurm_job_that_stays_pending_fails_with_its_reason(slurm):
    t0 = time.monotonic()
    with pytest.raises(LabError, match=r"PENDING \(BeginTime\)") as err:
        labkit.Lab.start(engines=2, launcher="slurm", sbatch=["--begin=now+1hour"],
                         **{**LOCAL, "start_timeout": 6})
    assert time.monotonic() - t0 < 40
    assert "squeue" in str(err.value)             # says where to look
    assert "ipengine" not in _squeue()            # the pending job was cancelled


def test_slurm_refusal_quotes_sbatch(slurm):
    with pytest.raises(LabError, match=r"sbatch: error: .*[Pp]artition"):
        labkit.Lab.start(engines=2, launcher="slurm", partition="no_such_partition", **LOCAL)


# -- MPI --------------------------------------------------------------------------------------
def test_mpi_engines_run_a_dp_step(mpi):
    with labkit.Lab.start(engines=2, launcher="mpi", timeout=60, oversubscribe=True,
                          environment=_mpi_env(), **LOCAL) as lab:
        _check_dp_step(lab, "mpi")


def test_mpirun_refusal_is_quoted(mpi):
    """Two engines on a host given one slot: mpirun refuses, and its words reach the user."""
    t0 = time.monotonic()
    with pytest.raises(LabError, match=r"not enough slots"):
        labkit.Lab.start(engines=2, launcher="mpi", hosts=["localhost:1"], environment=_mpi_env(), **LOCAL)
    assert time.monotonic() - t0 < 40


@pytest.mark.skipif(os.geteuid() != 0, reason="mpirun's refusal to run as root needs root")
def test_mpirun_refuses_root_without_the_override(mpi):
    with pytest.raises(LabError, match=r"OMPI_ALLOW_RUN_AS_ROOT"):
        labkit.Lab.start(engines=2, launcher="mpi", oversubscribe=True, **LOCAL)


def test_engine_that_never_registers_times_out_with_its_output(mpi, tmp_path):
    """A stand-in for an engine stuck before registering (a hung import, a wrong network)."""
    marker = f"labkit-stuck-{os.getpid()}"
    stuck = tmp_path / "python"
    stuck.write_text(f"#!/bin/sh\necho '{marker}: stuck before registering' >&2\nexec sleep 300\n")
    stuck.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(LabError, match=r"0 of 2 engines registered within 5 s") as err:
        labkit.Lab.start(engines=2, launcher="mpi", python=str(stuck), oversubscribe=True,
                         environment={**_mpi_env(), "LABKIT_TEST_MARK": marker}, **{**LOCAL, "start_timeout": 5})
    assert time.monotonic() - t0 < 40
    assert f"{marker}: stuck before registering" in str(err.value)
    assert _processes_marked(marker) == []        # mpirun and its stuck ranks were stopped


def _processes_marked(marker: str) -> list[int]:
    """Processes whose environment carries LABKIT_TEST_MARK=marker (what one test started)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"LABKIT_TEST_MARK={marker}".encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


# -- SSH --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sshd():
    """An sshd on 127.0.0.1 with its own config, host key and authorized key in a temp folder."""
    _require(_ssh_missing())
    os.makedirs("/run/sshd", exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="labkit-sshd-"))
    keygen = ["ssh-keygen", "-q", "-N", "", "-t", "ed25519", "-f"]
    for name in ("host_key", "id", "other_id"):
        subprocess.run(keygen + [str(root / name)], check=True)
    shutil.copy(root / "id.pub", root / "authorized_keys")
    port = _free_port()
    (root / "sshd_config").write_text(f"""ListenAddress 127.0.0.1
Port {port}
HostKey {root}/host_key
AuthorizedKeysFile {root}/authorized_keys
PidFile {root}/sshd.pid
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
Subsystem sftp internal-sftp
""")
    for name, key in (("ssh_config", "id"), ("bad_ssh_config", "other_id")):
        (root / name).write_text(f"""Host *
  User {getpass.getuser()}
  IdentityFile {root}/{key}
  IdentitiesOnly yes
  UserKnownHostsFile {root}/known_hosts
  StrictHostKeyChecking no
  LogLevel ERROR
""")
    sshd_bin = shutil.which("sshd") or "/usr/sbin/sshd"
    proc = subprocess.Popen([sshd_bin, "-D", "-f", str(root / "sshd_config"), "-E", str(root / "sshd.log")])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    else:
        proc.kill()
    if proc.poll() is not None:
        log = (root / "sshd.log").read_text() if (root / "sshd.log").exists() else ""
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"sshd did not start: {log[-500:]}")
    yield {"host": f"127.0.0.1:{port}", "config": str(root / "ssh_config"),
           "bad_config": str(root / "bad_ssh_config"), "root": root}
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(root, ignore_errors=True)


def test_ssh_engines_run_a_dp_step(sshd):
    with labkit.Lab.start(engines=2, launcher="ssh", timeout=60, hosts={sshd["host"]: 2},
                          ssh_args=["-F", sshd["config"]], python=sys.executable, **LOCAL) as lab:
        _check_dp_step(lab, "lab")                 # no rank variables over ssh: the lab assigns them


def test_ssh_refused_key_is_quoted(sshd):
    t0 = time.monotonic()
    with pytest.raises(LabError, match=r"Permission denied \(publickey\)"):
        labkit.Lab.start(engines=2, launcher="ssh", hosts={sshd["host"]: 2},
                         ssh_args=["-F", sshd["bad_config"]], **LOCAL)
    assert time.monotonic() - t0 < 40
