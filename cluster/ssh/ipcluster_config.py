# labkit: engines started over ssh on a list of hosts, one per GPU.
#
#   ipython profile create labkit_ssh --parallel
#   cp cluster/ssh/ipcluster_config.py ~/.ipython/profile_labkit_ssh/
#   ipcluster start --profile=labkit_ssh -n 8 --daemonize
#   # notebook:  lab = labkit.Lab.connect(profile="labkit_ssh", engines=8)
#   # or:        lab = labkit.Lab.start(engines=8, launcher="ssh", hosts={"node1": 4, "node2": 4})
#   ipcluster stop --profile=labkit_ssh
#
# ssh sets no rank variables: the lab assigns ranks by host name, then process id, and local
# ranks count per host (local rank i drives cuda:i). You need key-based login without a
# password prompt (BatchMode) from this machine to every host.
c = get_config()  # noqa: F821

c.Cluster.engine_launcher_class = "ssh"
# Every interface, so the hosts reach the controller: trusted network only (messages are
# signed, not encrypted; torch's rendezvous store has no authentication).
c.Cluster.controller_ip = "*"

# host (or user@host, or host:port) -> engines on it (= its GPUs)
c.SSHEngineSetLauncher.engines = {"node1": 4, "node2": 4}
# The engines' Python on the hosts: the one with labkit, torch and ipyparallel installed.
# (The default, "python3", often lacks them.)
c.SSHEngineSetLauncher.remote_python = "/shared/me/labkit/.venv/bin/python"
# Fail at once instead of waiting at a password prompt nobody sees.
c.SSHEngineSetLauncher.ssh_args = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
c.SSHEngineSetLauncher.scp_args = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
# Where the connection files go on the hosts (relative paths are under the remote home).
# c.SSHEngineSetLauncher.remote_profile_dir = ".ipython/profile_labkit_ssh"
