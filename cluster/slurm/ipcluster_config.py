# labkit: engines as one Slurm job, one task (= one engine, one rank) per GPU.
#
#   ipython profile create labkit_slurm --parallel
#   cp cluster/slurm/ipcluster_config.py ~/.ipython/profile_labkit_slurm/
#   # edit the #SBATCH lines below (partition, account, time, nodes × GPUs), then either
#   ipcluster start --profile=labkit_slurm -n 8 --daemonize     # controller here, engines in a job
#   # notebook:  lab = labkit.Lab.connect(profile="labkit_slurm", engines=8)
#   # or, from the notebook in one step (this file is read first, options override it):
#   #   lab = labkit.Lab.start(engines=8, launcher="slurm", profile="labkit_slurm")
#   ipcluster stop --profile=labkit_slurm                       # scancel's the job
#
# Ranks come from SLURM_PROCID, local ranks from SLURM_LOCALID: engine i on a node drives
# cuda:i (torch.cuda.set_device, NCCL). The controller runs where you run ipcluster (a login
# node, or the node your notebook is on); the engines' nodes must reach it on its ports.
c = get_config()  # noqa: F821

c.Cluster.engine_launcher_class = "slurm"
# "*" = listen on every interface, so engines on compute nodes can connect. Messages are
# signed, not encrypted, and torch's rendezvous store has no authentication: trusted network only.
c.Cluster.controller_ip = "*"
# If the compute nodes know this machine by another name (e.g. a high-speed interface),
# give it here; it is written into the engines' connection file.
# c.Cluster.controller_location = "login1-ib"

# The engines' Python: the one with labkit, torch and ipyparallel (same path on every node,
# e.g. a venv on a shared filesystem).
# c.SlurmEngineSetLauncher.engine_cmd = ["/shared/me/labkit/.venv/bin/python", "-m", "ipyparallel.engine"]

# One job for all engines. Engines per node = GPUs per node; -n (total engines) = nodes × that.
# {n}, {cluster_id}, {output_file}, {program_and_args} are filled in by ipyparallel.
c.SlurmEngineSetLauncher.batch_template = """#!/bin/bash
#SBATCH --job-name=ipengine-{cluster_id}
#SBATCH --ntasks={n}
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=02:00:00
#SBATCH --partition=gpu
##SBATCH --account=my_project
#SBATCH --output={output_file}
#SBATCH --export=ALL
# Each task sees all 4 GPUs of its node and picks cuda:$SLURM_LOCALID. (With
# --gpus-per-task=1 instead, each task sees one GPU as cuda:0; labkit handles both.)
srun {program_and_args}
"""
# Where sbatch writes this script (default: the current folder).
# c.SlurmEngineSetLauncher.batch_file_name = "/tmp/labkit_engines.sbatch"

# How long the lab waits for engines (a queued job may wait longer: Lab.start(start_timeout=...)).
c.Cluster.engine_timeout = 600
